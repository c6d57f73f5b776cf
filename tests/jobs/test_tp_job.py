"""The pretraining job's ``--tp N`` (examples/pretrain/setup.py ``tp_mesh``; docs/tp.md): world 4 as dp 2 x tp 2 on
the tiny preset, a checkpoint at step 2 (written in the background: ``--async-save``), then a resume at the same layout (bit for bit: the same reductions in the
same order) and one at tp 2 x dp 1 (world 2, twice the sequences per rank: the same global batch) with
``--loss-parallel``, which loads the params-form checkpoint into another data-parallel size and continues within
fp32 rounding (the gradients are averaged over another number of ranks, the cross-entropy is computed on the
vocabulary's slices). The flags TP does not run with are refused with one line."""
import contextlib
import io
import os

import pytest

from job_utils import close, losses, metrics, run_job


def test_tp_job_trains_saves_and_resumes(tmp_path):
    full, same, narrow = (str(tmp_path / n) for n in ("full", "same", "narrow"))
    a = run_job(["--tp", "2", "--steps", "4", "--save-every", "2", "--async-save", "--out", full], nproc=4)
    assert "TP 2 x 2 data-parallel ranks (sequence parallel)" in a.stdout, a.stdout[-2000:]
    assert "2 seq x 2 ranks x 1 accum = 4 seq" in a.stdout, a.stdout[-2000:]  # the data-parallel ranks read
    ckpt = os.path.join(full, "checkpoints", "step_00000002")
    b = run_job(["--tp", "2", "--steps", "4", "--resume", ckpt, "--out", same], nproc=4)
    assert "resumed from" in b.stdout
    assert losses(same) == losses(full)[2:], (losses(same), losses(full))
    c = run_job(["--tp", "2", "--loss-parallel", "--batch-size", "4", "--steps", "4", "--resume", ckpt, "--out",
                 narrow], nproc=2)
    assert "written by 4 rank(s), loaded by 2" in c.stdout and "loss parallel" in c.stdout, c.stdout[-2000:]
    assert [r["step"] for r in metrics(narrow)] == [3, 4]
    assert close(losses(narrow), losses(full)[2:], rel=1e-5), (losses(narrow), losses(full))


@pytest.mark.parametrize("flags, says", [
    (["--tp", "2", "--compile"], "--tp 2 with --compile"),
    (["--tp", "2", "--gather-dtype", "fp8"], "--tp 2 with --gather-dtype fp8"),
    (["--tp", "2", "--export-hf", "x"], "HF export is not supported with TP"),
    (["--tp", "2", "--checkpointing", "all"], "use --activation-checkpointing"),
    (["--tp", "2", "--sample-tokens", "5"], "--sample-tokens 0"),
    (["--tp", "4", "--seq-len", "30"], "a multiple of 4"),
    (["--loss-parallel"], "needs --tp N"),
    (["--tp", "2", "fine-tune"], "LoRA adapters are not supported with TP"),
])
def test_tp_flags_refused(flags, says):
    from pretrain.args import parse_args

    if flags[-1] == "fine-tune":  # examples/finetune_lora.py shares the flags and refuses --tp
        from finetune_lora import parse_args

        flags = flags[:-1]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        parse_args(["--preset", "tiny", *flags])
    assert e.value.code == 2 and says in err.getvalue() and err.getvalue().count("\n") == 1, err.getvalue()
