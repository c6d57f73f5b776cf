"""The pretraining job's ``--tp N`` (examples/pretrain/setup.py ``tp_mesh``; docs/tp.md): world 4 as dp 2 x tp 2 on
the tiny preset, a checkpoint at step 2 (written in the background: ``--async-save``), then a resume at the same layout (bit for bit: the same reductions in the
same order; with ``--memory-budget``, the activations traced on the TP mesh) and one at tp 2 x dp 1 (world 2, twice the sequences per rank: the same global batch) with
``--loss-parallel`` and ``--export-hf`` (the export reloaded and its logits compared), which loads the params-form checkpoint into another data-parallel size and continues within
fp32 rounding (the gradients are averaged over another number of ranks, the cross-entropy is computed on the
vocabulary's slices). The flags TP does not run with are refused with one line."""
import contextlib
import io
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from job_utils import close, events, losses, metrics, run_job


def test_tp_job_trains_saves_and_resumes(tmp_path):
    full, same, narrow = (str(tmp_path / n) for n in ("full", "same", "narrow"))
    a = run_job(["--tp", "2", "--steps", "4", "--save-every", "2", "--async-save", "--out", full], nproc=4)
    assert "TP 2 x 2 data-parallel ranks (sequence parallel)" in a.stdout, a.stdout[-2000:]
    assert "2 seq x 2 ranks x 1 accum = 4 seq" in a.stdout, a.stdout[-2000:]  # the data-parallel ranks read
    ckpt = os.path.join(full, "checkpoints", "step_00000002")
    hf_dir = str(tmp_path / "hf")
    with ThreadPoolExecutor(2) as pool:  # both resume the step-2 checkpoint: side by side
        b = pool.submit(run_job, ["--tp", "2", "--steps", "4", "--resume", ckpt, "--out", same, "--memory-budget",
                                  "1TiB"], nproc=4)
        c = pool.submit(run_job, ["--tp", "2", "--loss-parallel", "--batch-size", "4", "--steps", "4", "--resume",
                                  ckpt, "--out", narrow, "--export-hf", hf_dir], nproc=2)
        b, c = b.result(), c.result()
    assert "resumed from" in b.stdout
    # --memory-budget at --tp 2: the activations traced on the TP mesh (meta tensors: nothing communicated); a
    # budget this large checkpoints none, so the losses stay bit for bit
    assert "activation checkpointing (auto) for a budget of 1024.00 GiB per device: 0 of 2 blocks" in b.stdout, b.stdout
    assert losses(same) == losses(full)[2:], (losses(same), losses(full))
    assert "written by 4 rank(s), loaded by 2" in c.stdout and "loss parallel" in c.stdout, c.stdout[-2000:]
    assert [r["step"] for r in metrics(narrow)] == [3, 4]
    assert close(losses(narrow), losses(full)[2:], rel=1e-5), (losses(narrow), losses(full))
    # --export-hf from a TP engine: the HF model reloaded on rank 0 gives the job's logits (gathered over the
    # vocabulary under --loss-parallel)
    ev = [e for e in events(narrow) if e["event"] == "export"][0]
    assert ev["check"]["missing"] == 0 and ev["check"]["unexpected"] == 0, ev
    assert ev["check"]["max_abs_diff"] < 1e-5, ev
    # --export-only at --tp 2: the newest checkpoint (step 4) loaded into a TP engine writes the same tensors
    again = str(tmp_path / "hf_again")
    run_job(["--tp", "2", "--export-only", "--export-hf", again, "--out", narrow], nproc=2)
    from safetensors.torch import load_file

    def tensors(d):
        return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}
    first, second = tensors(hf_dir), tensors(again)
    assert first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)


@pytest.mark.parametrize("flags, says", [
    (["--tp", "2", "--compile"], "--tp 2 with --compile"),
    (["--tp", "2", "--gather-dtype", "fp8"], "--tp 2 with --gather-dtype fp8"),
    (["--tp", "2", "--init-from-hf", "x"], "resume at --tp N"),
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
