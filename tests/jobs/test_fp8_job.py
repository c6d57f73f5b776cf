"""The main job with ``--gather-dtype fp8``: the decoder layers are gathered as FP8 records, and a
resumed run continues bit for bit (the records are derived from the checkpointed master, never
stored). See [Note: compact trainable gathers] in yafsdp/formats/fp8_codec.py."""
import os

from job_utils import losses, run_job


def test_pretrain_fp8_gathers_and_exact_resume(tmp_path):
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    a = run_job(["--gather-dtype", "fp8", "--steps", "4", "--save-every", "2", "--out", full])
    assert "fp8 weight gathers (2 units)" in a.stdout, a.stdout[-2000:]
    ckpt = os.path.join(full, "checkpoints", "step_00000002")
    b = run_job(["--gather-dtype", "fp8", "--steps", "4", "--resume", ckpt, "--out", half])
    assert "resumed from" in b.stdout
    assert losses(half) == losses(full)[2:], (losses(half), losses(full))
