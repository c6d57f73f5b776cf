"""benchmarks/gpu_suite.sh must not rot while no GPU runs it, and must fit its 15 minutes: its dry run
lists every step of each part with its time limit; the steps of a part fit the part's limit and the parts
together fit 15 minutes of a GPU machine, its start included; every benchmark it calls exists and knows
every flag (and engine, preset) it is given; its pytest step runs every file that holds a `gpu` test."""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITE = "benchmarks/gpu_suite.sh"
DEVICE_BUDGET_S = 900  # the suite's whole time on a GPU machine: 15 minutes, the machine's start included
MACHINE_START_S = 150  # what a start costs (minutes, per the device tool); kept free of the parts
PER_CALL_S = 600  # one device call's limit

PARTS = {
    "part1": ["versions", "build", "kernels-check", "gpu-tests"],
    "part2": ["versions", "build-if-missing", "fake-world-memory", "world1-memory", "step-bench", "step-phases", "overlap-world1", "ckpt-auto", "launch-shapes",
              "kernel-bench", "torchtitan-trainer"],
}
ONLY_ON_A_FRESH_MACHINE = {"build-if-missing"}  # part1's build is normally there: not counted in part2's limit


def _dry(*args):
    env = {k: v for k, v in os.environ.items() if k != "PART_LIMIT_S"}  # the limits as the file sets them
    return subprocess.run(["bash", SUITE, *args, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.fixture(scope="module")
def parts():
    out = _dry("all")
    assert out.returncode == 0, out.stderr
    parts, cur = {}, None
    for line in out.stdout.splitlines():
        m = re.match(r"^=== part (\w+) \[limit (\d+) s\]$", line)
        if m:
            cur = parts.setdefault(m.group(1), dict(limit=int(m.group(2)), steps=[]))
            continue
        m = re.match(r"^=== ([\w-]+) \[limit (\d+) s\]: (.*)$", line)
        assert m and cur is not None, f"unexpected dry-run line: {line!r}"
        cur["steps"].append((m.group(1), int(m.group(2)), m.group(3)))
    return parts


def test_parts_and_their_steps(parts):
    assert {p: [n for n, _, _ in v["steps"]] for p, v in parts.items()} == PARTS
    for p in PARTS:  # one part alone dry-runs the same steps
        one = _dry(p)
        assert one.returncode == 0 and re.findall(r"^=== ([\w-]+) \[", one.stdout, flags=re.M) == PARTS[p]


def test_time_limits_fit_the_device_budget(parts):
    for p, v in parts.items():
        counted = sum(limit for name, limit, _ in v["steps"] if name not in ONLY_ON_A_FRESH_MACHINE)
        assert counted <= v["limit"], f"{p}: its steps' limits sum to {counted} s, over the part's {v['limit']} s"
        assert v["limit"] <= 500 and v["limit"] + 60 <= PER_CALL_S, (p, v["limit"])  # room for a call's overhead
    total = sum(v["limit"] for v in parts.values())
    assert total + MACHINE_START_S <= DEVICE_BUDGET_S, (
        f"parts {total} s + the machine's start {MACHINE_START_S} s exceed the suite's {DEVICE_BUDGET_S} s")


def test_benchmarks_exist_and_know_every_flag_and_value(parts):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from _common import ENGINES, REDUCE_ENGINES
    finally:
        sys.path.pop(0)
    from yafsdp.presets import PRESETS

    scripts = sorted({s for part in parts.values() for _, _, cmd in part["steps"]
                      for s in re.findall(r"(benchmarks/\w+\.py)", cmd)})
    for script in scripts:
        assert os.path.isfile(os.path.join(ROOT, script)), script
    # every script's --help at once (each is mostly an interpreter importing torch)
    procs = {s: subprocess.Popen([sys.executable, s, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for s in scripts}
    helps: dict[str, str] = {}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        helps[script] = out
    seen = set()
    for part in parts.values():
        for name, _, cmd in part["steps"]:
            for script in re.findall(r"(benchmarks/\w+\.py)", cmd):
                seen.add(script)
                tail = cmd.split(script, 1)[1]
                known = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", helps[script]))
                for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", tail):
                    assert flag in known, f"step {name}: {script} has no {flag}"
                for preset in re.findall(r"--preset (\S+)", tail):
                    assert preset in PRESETS, (name, preset)
                for engines in re.findall(r"--engines (\S+)", tail):
                    unknown = set(engines.split(",")) - set(ENGINES) - set(REDUCE_ENGINES)
                    assert not unknown, f"step {name}: unknown engines {unknown}"
    assert {"benchmarks/bench_step.py", "benchmarks/bench_ckpt_auto.py", "benchmarks/bench_optimizer.py"} <= seen


def test_gpu_tests_step_runs_every_file_with_gpu_tests(parts):
    cmd = dict((n, c) for n, _, c in parts["part1"]["steps"])["gpu-tests"]
    assert " -m gpu " in cmd and "--junitxml=" in cmd
    listed = set(re.findall(r"(tests/\S+\.py)", cmd))
    want = {os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
            if re.search(r"pytest\.mark\.gpu", open(f).read())}
    assert listed == want and any(f.endswith("test_gpu.py") for f in listed), (listed, want)
    assert all(os.path.isfile(os.path.join(ROOT, f)) for f in listed)


def test_gpu_suite_refuses_unknown_or_missing_parts():
    for args, says in ((["--bogus"], "unknown argument --bogus"), (["part3"], "unknown argument part3"),
                       ([], "name a part: part1, part2, all or multigpu")):
        out = subprocess.run(["bash", SUITE, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)
    assert subprocess.run(["bash", "-n", SUITE], cwd=ROOT).returncode == 0  # the whole file parses


def test_multigpu_part_runs_every_multigpu_test_and_skips_on_one_gpu():
    """The multigpu part (its own machine: not in ``all``): one pytest step over every file with a test
    marked for several GPUs, within one device call; on fewer than two GPUs it prints why and exits 0."""
    out = _dry("multigpu")
    assert out.returncode == 0, out.stderr
    assert re.match(r"^=== part multigpu \[limit (\d+) s\]$", out.stdout.splitlines()[0])
    limit = int(re.findall(r"^=== part multigpu \[limit (\d+) s\]$", out.stdout, flags=re.M)[0])
    steps = re.findall(r"^=== ([\w-]+) \[limit (\d+) s\]: (.*)$", out.stdout, flags=re.M)
    assert [n for n, _, _ in steps] == ["versions", "build-if-missing", "multigpu-tests"]
    assert sum(int(t) for _, t, _ in steps) <= limit and limit + 60 <= PER_CALL_S
    cmd = steps[-1][2]
    assert " -m multigpu " in cmd and "--junitxml=" in cmd
    marker = "pytest.mark." + "multigpu"  # spelled apart: this file holds no such test
    want = {os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
            if marker in open(f).read()}
    assert want and set(re.findall(r"(tests/\S+\.py)", cmd)) == want, (cmd, want)
    if shutil.which("nvidia-smi") is None:  # no GPU listed here: the part says why it ran nothing
        run = subprocess.run(["bash", SUITE, "multigpu"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "multigpu: skipped: 0 GPU(s)" in run.stdout, (run.stdout, run.stderr)


def test_docs_table_names_real_tests_cases_and_steps(parts):
    """docs/testing.md's GPU suite table: every test, race/no-sync case and suite step it names exists."""
    text = open(os.path.join(ROOT, "docs", "testing.md")).read()
    section = text[text.index("## GPU suite"):]
    sources = "".join(open(f).read() for f in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True))
    tests = set(re.findall(r"`(?:[\w/]+\.py)?(?:::)?(test_\w+)\b(?!\.)", section))
    assert len(tests) >= 15, tests
    for t in tests:
        assert re.search(rf"^def {t}\(", sources, flags=re.M), f"docs/testing.md names {t}, which no test file defines"
    cases = set(re.findall(r"cases? `((?:z[23]|bf16)\w*)`", section))
    cases |= set(re.findall(r"cases `\w+`, `(\w+)`", section))
    assert len(cases) >= 8, cases
    for c in cases:
        assert f'"{c}"' in sources, f"docs/testing.md names the case {c}, which no test defines"
    steps = {n for v in parts.values() for n, _, _ in v["steps"]} | {"multigpu-tests"}
    for s in re.findall(r"part[12] `([\w-]+)`", section):
        assert s in steps, f"docs/testing.md names the step {s}, which gpu_suite.sh does not have"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_cuda_launch_shapes_compiles(tmp_path):
    """benchmarks/cuda_launch_shapes.cu (the kernels' launch shapes, timed without torch) still compiles
    against csrc/'s headers: it is only run on a GPU machine, so a header change would otherwise break it
    unseen."""
    proc = subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90", "-I", os.path.join(ROOT, "csrc"),
                           "-o", str(tmp_path / "launch_shapes"),
                           os.path.join(ROOT, "benchmarks", "cuda_launch_shapes.cu")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
