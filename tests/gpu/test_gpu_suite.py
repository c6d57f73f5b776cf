"""benchmarks/gpu_suite.sh must not rot while no GPU is lent: its dry run lists every step, every
script it calls exists, and every flag it passes is one that script's --help knows."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_suite_dry_run_names_real_scripts_and_flags():
    out = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    steps = re.findall(r"^=== ([\w-]+): (.*)$", out.stdout, flags=re.M)
    names = [n for n, _ in steps]
    assert names == ["versions", "build", "kernels-check", "gpu-tests", "kernel-bench", "step-bench",
                     "reduce-bench", "fake-world-memory", "overlap", "ckpt-auto"], names
    helps: dict[str, str] = {}
    for name, cmd in steps:
        for script in re.findall(r"(benchmarks/\w+\.py)", cmd):
            assert os.path.isfile(os.path.join(ROOT, script)), (name, script)
            if script not in helps:
                h = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                                   timeout=120)
                assert h.returncode == 0, h.stderr
                helps[script] = h.stdout
            tail = cmd.split(script, 1)[1]
            for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", tail):
                assert flag in helps[script], f"step {name}: {script} has no {flag}"
    assert "-m gpu" in dict(steps)["gpu-tests"]


def test_gpu_suite_rejects_unknown_arguments():
    out = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "--bogus"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr
