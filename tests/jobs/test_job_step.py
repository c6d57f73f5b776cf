"""The job's loop around ``Job.train_step`` (examples/pretrain/job.py): the non-finite guard counts
skipped steps *in a row* -- a finite step in between starts the count again -- and skipped steps are
marked in metrics.jsonl and take no optimizer step. One process (a world of one), NaN losses injected
at chosen steps by patching ``Job.loss``."""
from __future__ import annotations

import json
import subprocess
import sys

from job_utils import FAST, ROOT, env

_NAN_AT = """
import os, sys
sys.path.insert(0, os.path.join({root!r}, "examples"))
import pretrain.job as J
orig = J.Job.loss
def loss(self, x):
    out = orig(self, x)
    return out * float("nan") if self.step + 1 in {steps!r} else out
J.Job.loss = loss
sys.exit(J.main(sys.argv[1:]))
"""


def test_skipped_steps_in_a_row_restart_after_a_finite_step(tmp_path):
    script = tmp_path / "nan_at.py"
    script.write_text(_NAN_AT.format(root=ROOT, steps=(2, 3, 5, 6)))
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, str(script)] + FAST + ["--steps", "7", "--max-skipped-steps", "3",
                                                                "--save-every", "0", "--out", str(out)],
                       env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]  # 2 in a row at most: no divergence
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if r.get("skipped")] == [2, 3, 5, 6]
    said = [line for line in p.stdout.splitlines() if line.startswith("skipped  step")]
    assert [line.split("(")[-1] for line in said] == ["1 in a row, stop at 3)", "2 in a row, stop at 3)"] * 2
    finite = [r for r in rows if not r.get("skipped")]
    assert len(finite) == 3 and all(r["loss"] == r["loss"] for r in finite)  # not NaN
    # and three in a row do stop the run (exit 3)
    script.write_text(_NAN_AT.format(root=ROOT, steps=(2, 3, 4)))
    p = subprocess.run([sys.executable, str(script)] + FAST + ["--steps", "7", "--max-skipped-steps", "3",
                                                                "--save-every", "0", "--out", str(tmp_path / "r2")],
                       env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 3 and "NaN/inf for 3 steps in a row (steps 2-4" in p.stderr, p.stderr[-3000:]
