"""The newcomer's entry points: examples/minimal.py (the README's "Use" block) under torchrun, and
examples/run_default.sh's set-up, which runs pip and the extension build only when needed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import torch

from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("RANK", None)
    return e


def _core(path: str) -> str:
    text = open(path).read()
    begin = text.index('# --- begin README "Use"\n') + len('# --- begin README "Use"\n')
    return text[begin:text.index('# --- end README "Use"')]


def test_minimal_example_runs_and_is_the_readme_block(tmp_path):
    core = _core(os.path.join(ROOT, "examples", "minimal.py"))
    assert "```python\n" + core + "```\n" in open(os.path.join(ROOT, "README.md")).read()
    out = str(tmp_path / "model.pt")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), os.path.join(ROOT, "examples", "minimal.py"), out],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", p.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0] - 1.5, p.stdout  # 5.57 -> 2.51 here
    assert "saved 21 tensors" in p.stdout
    from transformers import LlamaConfig, LlamaForCausalLM

    sd = torch.load(out)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    assert model.load_state_dict(sd, strict=True) is not None and sd.keys() == model.state_dict().keys()
    ids = torch.tensor([list(b"We the People of the United States")])
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() < 3.5  # it learned the corpus' bytes


def test_run_default_setup_is_idempotent(tmp_path):
    """SETUP_DRY_RUN=1 in a copy of the checkout: with no stamp it would build; with the stamp of
    the last build it does nothing (in seconds); a changed csrc/ file makes it build again. torch
    and the dependencies are installed here, so pip is never asked for them."""
    repo = tmp_path / "repo"
    for d in ("csrc", "yafsdp"):
        shutil.copytree(os.path.join(ROOT, d), repo / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("setup.py", "pyproject.toml", "examples/run_default.sh"):
        os.makedirs(repo / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(ROOT, f), repo / f)
    env = dict(os.environ, SETUP_DRY_RUN="1", PYTHONPATH=str(repo), PYTHON=sys.executable)

    def setup():
        t0 = time.perf_counter()
        p = subprocess.run(["bash", str(repo / "examples" / "run_default.sh")], capture_output=True, text=True,
                           env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout, time.perf_counter() - t0

    first, _ = setup()
    assert "setup    torch 2.13.0" in first and "already installed" in first and "pip install -q torch" not in first
    assert "building yafsdp and its extension (no set-up stamp)" in first
    assert "would run: " + sys.executable + " -m pip install -q --no-build-isolation -e ." in first
    stamp = re.search(r"stamp ([0-9a-f]{16})", first).group(1)
    os.makedirs(repo / "build")
    (repo / "build" / "yafsdp-setup.stamp").write_text(stamp + "\n")
    second, seconds = setup()
    assert f"up to date (stamp {stamp})" in second and "would run" not in second, second
    assert seconds < 20, seconds  # a few python start-ups; the real pip + build take ~50 s
    src = sorted(f for f in os.listdir(repo / "csrc") if f.endswith(".cpp"))[0]
    with open(repo / "csrc" / src, "a") as f:
        f.write("\n// changed\n")
    third, _ = setup()
    assert "csrc/, setup.py or torch changed since the last build" in third and "-e ." in third
