"""The main job, examples/pretrain_llama.py, launched the way users launch it (torchrun, subprocesses).

One module-scoped set of small runs (tiny preset, 12 steps) serves every assertion:
- ``ref``   : 2 "nodes" x 1 rank (c10d rendezvous), embedded corpus, 12 steps, HF export;
- ``half``  : 1 node x 2 ranks, the same corpus as a pre-tokenized .bin, stopped at step 6, then
              ``--resume`` to 12 -> the same losses as ``ref``, bit for bit;
- ``to1``   : ``half``'s step-6 checkpoint resumed on 1 rank with --grad-accum 2 (same global batch),
              through a local HF tokenizer folder and a .jsonl copy of the corpus (2 -> 1);
- ``hf``    : --init-from-hf ref's export on 1 rank (--steps 0: a checkpoint at step 0), then that
              checkpoint resumed on 2 ranks and exported again (1 -> 2) -> identical weights.
The data-format and tokenizer helpers are tested in-process.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dist_utils import free_port

from job_utils import FAST, HSDP_JOB_ARGS, JOB, ROOT, close, env, events, losses, metrics, run_job, torchrun_cmd, tree_digest  # noqa: F401
from pretrain import data as D  # examples/ is on pytest's pythonpath (pyproject.toml)

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("job")
    out = {k: str(base / k) for k in ("ref", "half", "to1", "hf")}
    # The embedded corpus in two other formats, tokenized identically.
    corpus = D.load_corpus(None, D.ByteTokenizer())
    bin_path = str(base / "corpus.bin")
    D.write_bin(corpus.tokens, bin_path, "uint16")
    jsonl_dir = base / "jsonl"
    jsonl_dir.mkdir()
    with open(jsonl_dir / "corpus.jsonl", "w") as f:
        for name in sorted(os.listdir(D.EMBEDDED_DIR)):
            if name.endswith(".txt"):
                with open(os.path.join(D.EMBEDDED_DIR, name), encoding="utf-8") as fh:
                    f.write(json.dumps({"text": fh.read()}) + "\n")
    tok_dir = str(base / "tokenizer")
    D.ByteTokenizer().save_pretrained(tok_dir)

    def lane_ref():  # 2 nodes x 1 rank; then HF in (1 rank) and out again (2 ranks)
        port = free_port()
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ref", "--nnodes", "2"]
        ref_args = ["--steps", "12", "--save-every", "6", "--async-save", "--out", out["ref"], "--export-hf",
                    os.path.join(out["ref"], "hf")]
        nodes = [subprocess.Popen(torchrun_cmd(1, rdzv + ["--node-rank", str(i)]) + FAST + ref_args, env=env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        logs = [n.communicate(timeout=300) for n in nodes]
        for n, (o, e) in zip(nodes, logs):
            assert n.returncode == 0, f"two-node run failed:\n{o[-3000:]}\n{e[-5000:]}"
        hf = run_job(["--steps", "0", "--init-from-hf", os.path.join(out["ref"], "hf"), "--out", out["hf"]], nproc=1)
        to2 = run_job(["--steps", "0", "--resume", "--out", out["hf"], "--export-hf", os.path.join(out["hf"], "hf")])
        return logs[0][0] + logs[1][0], hf, to2

    def lane_half():  # 1 node x 2 ranks: 6 steps, resumed to 12; the step-6 checkpoint on 1 rank
        first = run_job(["--steps", "6", "--data", bin_path, "--out", out["half"]])
        shutil.copytree(out["half"], out["to1"])
        with ThreadPoolExecutor(1) as resumes:  # the two resumes of the step-6 checkpoint side by side
            to1 = resumes.submit(run_job, ["--steps", "12", "--resume", "--grad-accum", "2", "--tokenizer", tok_dir,
                                           "--data", str(jsonl_dir / "corpus.jsonl"), "--out", out["to1"]], nproc=1)
            second = run_job(["--steps", "12", "--data", bin_path, "--resume", "--out", out["half"],
                              "--peak-tflops", "0.01", "--tensorboard", str(base / "tb")])
            to1 = to1.result()
        return first, second, to1

    # Two independent lanes side by side: their start-ups (imports, rendezvous) overlap.
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(lane_ref), pool.submit(lane_half)
        (ref_stdout, hf, to2), (first, second, to1) = a.result(), b.result()
    return dict(out=out, ref_stdout=ref_stdout, first=first, second=second, to1=to1, to2=to2, tb=str(base / "tb"),
                hf=hf, bin=bin_path, tok=tok_dir, base=str(base))


# ------------------------------------------------------------------------------------ the runs
def test_default_run_outputs(runs):
    ref = runs["out"]["ref"]
    rows = metrics(ref)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem_gb", "tokens"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # it learns
    assert rows[0]["lr"] < rows[3]["lr"]  # warmup
    assert os.path.getsize(os.path.join(ref, "loss.png")) > 1000
    ck = sorted(os.listdir(os.path.join(ref, "checkpoints")))
    assert ck == ["step_00000006", "step_00000012"]
    out = runs["ref_stdout"]
    for word in ("model ", "data ", "batch ", "optim ", "done ", "loss ", "export "):
        assert word in out, word
    ev = [e["event"] for e in events(ref)]
    assert ev[0] == "start" and ev[-1] == "end" and "export" in ev
    run = json.load(open(os.path.join(ref, "run.json")))
    assert run["world"] == 2 and run["optimizer"] in ("yafsdp.FusedAdamW", "torch.optim.AdamW(fused)",
                                                       "torch.optim.AdamW(foreach)")


def test_two_nodes_match_one_node_and_exact_resume(runs):
    """ref ran on 2 nodes x 1 rank; half on 1 node x 2 ranks, stopped at 6 and resumed to 12."""
    assert losses(runs["out"]["half"]) == losses(runs["out"]["ref"])
    ev = events(runs["out"]["half"])
    resume = [e for e in ev if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 6 and resume[0]["checkpoint"].endswith("step_00000006")
    assert "resumed from" in runs["second"].stdout


def test_async_save_reports_when_complete(runs):
    """ref saved step 6 with --async-save: staged, then 'saved' once complete; the same losses as half."""
    out = runs["ref_stdout"]
    staged = out.index("saving   step 6 in the background (training blocked")
    done = out.index("saved    ", staged)
    assert "step_00000006 (" in out[done:done + 300] and "in the background)" in out[done:done + 300]
    ev = events(runs["out"]["ref"])
    assert [e["step"] for e in ev if e["event"] == "save_staged"] == [6]
    assert [(e["step"], e.get("background")) for e in ev if e["event"] == "save"] == [(6, True), (12, None)]


def test_reshard_2_to_1(runs):
    """half's 2-rank checkpoint at step 6, resumed on 1 rank with 2 accumulation steps: the same
    samples per step, so the same losses up to summation order (and the same tokens via an HF
    tokenizer folder reading a .jsonl copy of the corpus)."""
    got = losses(runs["out"]["to1"])
    ref = losses(runs["out"]["ref"])
    assert got[:6] == ref[:6]  # the first six lines are the 2-rank run's
    assert close(got[6:], ref[6:]), (got, ref)
    assert "written by 2 rank(s), loaded by 1" in runs["to1"].stdout


def test_export_loads_with_from_pretrained_same_logits(runs):
    """The export loads with no missing/unexpected keys and gives the trained model's logits: those
    of the final checkpoint, loaded into a fresh YaFSDP model on one rank."""
    from transformers import LlamaForCausalLM

    hf_dir = os.path.join(runs["out"]["ref"], "hf")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(hf_dir))
    model, info = LlamaForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.tensor([[ord(c) for c in "We the People of the United States"]])
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    ours = _logits_from_checkpoint(hf_dir, os.path.join(runs["out"]["ref"], "checkpoints", "step_00000012"), ids)
    assert torch.allclose(theirs, ours, rtol=0, atol=1e-5), (theirs - ours).abs().max()
    ev = [e for e in events(runs["out"]["ref"]) if e["event"] == "export"][0]
    assert ev["check"]["missing"] == 0 and ev["check"]["max_abs_diff"] < 1e-5
    # The byte tokenizer is exported too.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert tok("We")["input_ids"] == [ord("W"), ord("e")]


def _logits_from_checkpoint(hf_dir, ckpt_dir, ids):
    """The trained model's logits: its last checkpoint in a fresh YaFSDP model (world of one, here)."""
    import torch.distributed as dist
    from transformers import AutoConfig, LlamaForCausalLM

    import yafsdp
    from yafsdp import checkpoint as C
    from yafsdp.init import meta_parameters

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = AutoConfig.from_pretrained(hf_dir)
        with meta_parameters():
            model = LlamaForCausalLM(cfg)
        model = yafsdp.YaFSDP(model)
        C.load_checkpoint(ckpt_dir, model)
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        dist.destroy_process_group()


def test_init_from_hf_and_reshard_1_to_2(runs):
    """HF weights -> 1-rank shards -> checkpoint -> 2-rank shards -> HF export: bit-identical.
    (Optimizer state across world sizes: tests/multirank/test_checkpoint_roundtrip.py.)"""
    from safetensors.torch import load_file

    a = load_file(os.path.join(runs["out"]["ref"], "hf", "model.safetensors"))
    b = load_file(os.path.join(runs["out"]["hf"], "hf", "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "each rank read only its shards' slices" in runs["hf"].stdout and "built on meta" in runs["hf"].stdout
    assert "written by 1 rank(s), loaded by 2" in runs["to2"].stdout


# ----------------------------------------------------------------------------------- bad input
def test_bad_input_refused_nothing_overwritten(runs, tmp_path):
    ref = runs["out"]["ref"]
    corrupt = str(tmp_path / "corrupt")
    shutil.copytree(ref, corrupt)
    newest = os.path.join(corrupt, "checkpoints", "step_00000012")
    victim = sorted(f for f in os.listdir(newest) if f.endswith(".distcp"))[0]
    raw = bytearray(open(os.path.join(newest, victim), "rb").read())
    raw[len(raw) // 3] ^= 0x5A
    open(os.path.join(newest, victim), "wb").write(bytes(raw))
    other = str(tmp_path / "other")
    shutil.copytree(ref, other)
    occupied = str(tmp_path / "occupied")  # its own copy: two jobs on one --out are refused (the lock)
    shutil.copytree(ref, occupied)
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    exp = str(tmp_path / "export_here")
    os.makedirs(exp)
    open(os.path.join(exp, "keep.txt"), "w").write("mine")
    before = {p: tree_digest(p) for p in (corrupt, other, occupied, exp)}
    cases = {
        "missing_data": (["--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o1")], "no such file"),
        "corrupt": (["--resume", "--out", corrupt], f"'{victim}' fails its CRC-32"),
        "shape": (["--resume", "--out", other, "--preset", "cpu-4x128"], "different model"),
        "nothing": (["--resume", "--out", empty], "nothing to resume"),
        "occupied": (["--out", occupied], "already holds a run"),
        "export_dir": (["--out", str(tmp_path / "o4"), "--export-hf", exp], "not empty"),
    }
    procs = {k: subprocess.Popen([sys.executable, JOB] + FAST + ["--steps", "2"] + a, env=env(), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k, (a, _) in cases.items()}
    for k, p in procs.items():
        o, e = p.communicate(timeout=240)
        assert p.returncode == 2, f"{k}: rc {p.returncode}\n{o[-2000:]}\n{e[-3000:]}"
        assert cases[k][1] in e, f"{k}: {e[-2000:]}"
        assert "Traceback" not in e, f"{k}: {e[-3000:]}"
    for k in ("missing_data", "export_dir"):
        out_dir = cases[k][0][cases[k][0].index("--out") + 1]
        assert not os.path.exists(out_dir), k  # nothing was created
    for p, d in before.items():
        assert tree_digest(p) == d, p  # nothing was changed


# -------------------------------------------------------------------------- data, in-process
def test_byte_tokenizer_and_hf_twin(runs):
    tok = D.ByteTokenizer()
    text = "We the People — ünïcode ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and int(ids.max()) < 256
    hf = D.HFTokenizer(runs["tok"])
    assert hf.vocab_size == 259 and hf.eos_id == tok.eos_id
    assert list(hf.encode(text)) == list(ids)


def test_corpus_formats_agree(runs, tmp_path):
    tok = D.ByteTokenizer()
    emb = D.load_corpus(None, tok)
    assert "embedded corpus" in emb.source and emb.documents >= 6 and len(emb.tokens) > 100_000
    b = D.load_corpus(runs["bin"], tok)
    assert isinstance(b.tokens, D.ConcatTokens) and np.array_equal(np.asarray(b.tokens), emb.tokens)
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "world"}) + "\n")
    d = D.load_corpus(str(tmp_path), tok, text_key="body")
    assert list(d.tokens) == [*b"hello", 257, *b"world", 257]
    with pytest.raises(D.DataError, match="line 1 has no string field 'text'"):
        D.load_corpus(str(tmp_path / "b.jsonl"), tok)
    with pytest.raises(D.DataError, match="fewer than --seq-len"):
        D.Batches(d.tokens, 64, 0, source="tiny")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(D.DataError, match="odd.bin.*3 bytes is not a whole number of uint16"):
        D.load_corpus(str(tmp_path / "odd.bin"), tok)
    (tmp_path / "blob.txt").write_bytes(b"abc\xff\xfe\x00def")
    with pytest.raises(D.DataError, match="blob.txt.*not UTF-8 text .invalid byte at offset 3"):
        D.load_corpus(str(tmp_path / "blob.txt"), tok)
    with pytest.raises(D.DataError, match="no such file"):
        D.load_corpus(str(tmp_path / "missing.txt"), tok)


def test_batch_order_is_a_function_of_the_cursor():
    tokens = np.arange(1000)
    b = D.Batches(tokens, 16, seed=3)
    # World 2 x accum 1 and world 1 x accum 2 see the same samples in the same micro-batches.
    w2 = [b.micro_batch(40, 0, r, 2, 4) for r in range(2)]
    w1 = [b.micro_batch(40, m, 0, 1, 4) for m in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(w2, w1))
    # Every window once per epoch, windows are contiguous token runs.
    seen = torch.cat([b.batch(0, b.windows)])
    assert sorted(int(s[0]) for s in seen) == [16 * i for i in range(b.windows)]
    assert all(torch.equal(s, torch.arange(int(s[0]), int(s[0]) + 17)) for s in seen)
    # A fresh object reproduces the order (resume needs nothing but the cursor).
    assert torch.equal(D.Batches(tokens, 16, seed=3).batch(123, 5), b.batch(123, 5))


# ------------------------------------------------------------------- after training: export, sample
GENERATE = os.path.join(ROOT, "examples", "generate.py")


def test_export_only_generate_and_special_tokens(runs, tmp_path):
    """--export-only writes the checkpoint's weights (2 ranks' shards, exported by 1) and touches
    none of the run's files; examples/generate.py samples the same tokens from the run directory
    (its newest checkpoint) and from the export; the exported config names the tokenizer's
    special tokens."""
    from safetensors.torch import load_file

    run = str(tmp_path / "run")
    shutil.copytree(runs["out"]["ref"], run, ignore=shutil.ignore_patterns("hf"))
    before = tree_digest(run)
    hf = str(tmp_path / "hf")
    whole = os.path.join(runs["out"]["ref"], "hf", "model.safetensors")
    # --max-shard-size: a third of the model, so the export is HF's sharded layout (3 files + index)
    p = run_job(["--export-only", "--out", run, "--export-hf", hf, "--max-shard-size", str(os.path.getsize(whole) // 3)],
                nproc=0)
    assert "export only (--export-only): no training, the weights of step 12" in p.stdout
    assert "done     export only" in p.stdout and "steps 12 ->" not in p.stdout
    after = tree_digest(run)
    assert {k: v for k, v in after.items() if k != "events.jsonl"} == {k: v for k, v in before.items()
                                                                       if k != "events.jsonl"}
    assert events(run)[-1]["event"] == "export" and events(run)[-1]["check"]["max_abs_diff"] == 0.0
    files = sorted(n for n in os.listdir(hf) if n.endswith(".safetensors"))
    assert len(files) >= 3 and os.path.isfile(os.path.join(hf, "model.safetensors.index.json")), files
    assert f"config.json + {len(files)} safetensors files + model.safetensors.index.json" in p.stdout
    a = {k: v for f in files for k, v in load_file(os.path.join(hf, f)).items()}
    b = load_file(whole)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    assert (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (258, 256, 257)  # <pad>, <bos>, <eos>
    # four one-process runs at once (each is mostly an interpreter importing torch): the refused export, the
    # sampling from the checkpoint and from the export (temperature 1, top-k 50: the same ids), a missing source
    flags = ["--temperature", "1", "--top-k", "50", "--seed", "3", "--tokens", "30", "--json"]
    cmds = [[JOB, *FAST, "--export-only", "--out", str(tmp_path / "none"), "--export-hf", str(tmp_path / "hf3")],
            [GENERATE, run, *flags], [GENERATE, hf, *flags], [GENERATE, str(tmp_path)]]
    procs = [subprocess.Popen([sys.executable, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for c in cmds]
    bad, *outs, missing = [subprocess.CompletedProcess(pr.args, 0, *pr.communicate(timeout=120)) for pr in procs]
    for r, pr in zip([bad, *outs, missing], procs):
        r.returncode = pr.returncode
    assert bad.returncode == 2 and "--export-only: nothing to export, no complete checkpoint in" in bad.stderr
    for o in outs:
        assert o.returncode == 0, o.stderr[-3000:]
    got = [json.loads(o.stdout) for o in outs]
    assert "checkpoint" in outs[0].stderr and "step_00000012" in outs[0].stderr and "HF export" in outs[1].stderr
    assert got[0]["ids"] == got[1]["ids"] and len(got[0]["ids"]) == 30 and len(set(got[0]["ids"])) > 3
    assert got[0]["text"].startswith("We the People") and got[0]["text"] == got[1]["text"]
    assert missing.returncode == 2 and "is neither an HF export (config.json), a checkpoint" in missing.stderr


def test_progress_mfu_tensorboard_and_windowed_summary(runs):
    """Per-step tokens/s per device and MFU (n/a on CPU unless --peak-tflops), the resume summary
    as windowed means, the header's non-default flags, --tensorboard degrading with a message."""
    from pretrain import progress as P

    ref_rows = metrics(runs["out"]["ref"])
    assert all(r["mfu"] is None and r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2, abs=0.1)
               for r in ref_rows)
    assert "MFU n/a (no agreed peak for CPU; pass --peak-tflops to get MFU)" in runs["ref_stdout"]
    rows = metrics(runs["out"]["half"])
    fpt = P.flops_per_token(158_016, 512 * 64, 2, 64, 32)  # the tiny preset at --seq-len 32
    assert fpt == 6 * (158_016 - 512 * 64) + 12 * 2 * 64 * 32
    for r in rows[6:]:  # the resumed steps ran with --peak-tflops 0.01
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s_per_device"] / 1e10, rel=1e-3, abs=1e-5)
    out = runs["second"].stdout
    flags = next(line for line in out.splitlines() if line.startswith("flags    ")).split()
    assert {"--resume", "--peak-tflops", "0.01", "--tensorboard", "--seq-len", "32"} <= set(flags), flags
    assert "--zero-stage" not in flags and "--lr" not in flags  # defaults are not repeated
    assert "MFU against --peak-tflops 0.01" in out
    before, after = [r["loss"] for r in rows[:6]], [r["loss"] for r in rows[9:]]
    want = (f"loss     {sum(before) / 6:.4f} (mean of steps 1-6) -> {sum(after) / 3:.4f} (mean of steps 10-12; "
            f"last step {rows[-1]['loss']:.4f})")
    assert want in out, out
    first = runs["first"].stdout  # a fresh run starts from its first step's loss
    assert f"loss     {rows[0]['loss']:.4f} (step 1) -> {sum(before[3:]) / 3:.4f} (mean of steps 4-6; " in first, first
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "--tensorboard" in out and "not logging, the tensorboard package is not installed" in out
        assert not os.path.exists(runs["tb"])
    else:
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(runs["tb"]))
    assert "nothing to train: the checkpoint is at step 0, --steps is 0" in runs["to2"].stdout


def test_plot_keeps_validation_across_resumes(runs):
    """half ran twice (to 6, then resumed to 12): both end-of-run validations are plotted, and the
    legend names the learning-rate line."""
    from pretrain import progress as P

    half = runs["out"]["half"]
    ends = [e for e in events(half) if e["event"] == "end"]
    assert [e["step"] for e in ends] == [6, 12] and all(e["val_loss"] is not None for e in ends)
    pts = P.validation_points(metrics(half), os.path.join(half, "events.jsonl"), None)
    assert pts == [(6, ends[0]["val_loss"]), (12, ends[1]["val_loss"])]
    # A point past the metrics (a branch abandoned by resuming an older checkpoint) is dropped.
    assert P.validation_points(metrics(half)[:6], os.path.join(half, "events.jsonl"), None) == pts[:1]
    labels = P.plot_loss(os.path.join(half, "metrics.jsonl"), os.path.join(half, "replot.png"),
                         events_path=os.path.join(half, "events.jsonl"))
    assert labels == ["train loss", "val loss", "learning rate (right axis)"]


def test_overwrite_says_what_it_discarded(runs, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(runs["out"]["ref"], run)
    p = run_job(["--overwrite", "--steps", "1", "--out", run, "--activation-checkpointing"], nproc=0)
    assert (f"overwrite discarded the run in {run}: 2 checkpoint(s) step_00000006, step_00000012, metrics.jsonl "
            "(12 steps, 1-12, last loss") in p.stdout
    assert "ZeRO-3 | activation checkpointing" in p.stdout
    flags = next(line for line in p.stdout.splitlines() if line.startswith("flags    ")).split()
    assert {"--activation-checkpointing", "--overwrite"} <= set(flags), flags
    assert [r["step"] for r in metrics(run)] == [1]


def test_compile_flag_trains_like_eager(tmp_path):
    """--compile: each unit's modules compiled on their own; the same losses as the eager run."""
    from concurrent.futures import ThreadPoolExecutor

    eager, comp = str(tmp_path / "eager"), str(tmp_path / "compiled")
    with ThreadPoolExecutor(2) as pool:  # two one-process jobs side by side
        e = pool.submit(run_job, ["--steps", "2", "--save-every", "0", "--out", eager], nproc=0)
        c = pool.submit(run_job, ["--steps", "2", "--save-every", "0", "--out", comp, "--compile"], nproc=0)
        e.result()
        p = c.result()
    flags = next(line for line in p.stdout.splitlines() if line.startswith("flags    ")).split()
    assert "--compile" in flags
    assert close(losses(comp), losses(eager), rel=1e-4), (losses(comp), losses(eager))


def test_crafted_checkpoint_runs_no_code(runs, tmp_path):
    """A checkpoint whose .metadata would run code on unpickling (checksums recomputed) is refused by
    examples/generate.py's loader and by the job's --resume, naming the file; the payload never runs."""
    import pickle

    from test_checkpoint_guarantees import Evil, _rewrite_manifest

    run = str(tmp_path / "run")
    shutil.copytree(runs["out"]["ref"], run, ignore=shutil.ignore_patterns("hf"))
    marker = str(tmp_path / "PWNED")
    path = os.path.join(run, "checkpoints", "step_00000012")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Evil(marker), f)
    _rewrite_manifest(path)
    sys.path.insert(0, os.path.dirname(GENERATE))
    try:
        import generate
    finally:
        sys.path.pop(0)
    with pytest.raises(generate.GenerateError, match=r"\.metadata' refers to io\.open.*refused"):
        generate.load(run)
    p = run_job(["--resume", "--steps", "13", "--out", run], nproc=0, check=False)
    assert p.returncode != 0 and "step_00000012/.metadata' refers to io.open" in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(marker)


def _training_state(path: str, tmp) -> dict:
    """A checkpoint's weights and optimizer state (``model.*``, ``optim.*``), read with DCP's own
    converter; the job's state and the RNG states (times, per rank) are left out."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = str(tmp / (os.path.basename(os.path.dirname(os.path.dirname(path))) + ".pt"))
    dcp_to_torch_save(path, dst)
    return {k: v for k, v in torch.load(dst, weights_only=False).items() if k.startswith(("model.", "optim."))}


def test_hsdp_async_save_resumes_exactly(hsdp_job_run, tmp_path):
    """--hsdp 2 --async-save at world 4 (2 replicas x 2 shard ranks; the run is conftest.py's
    ``hsdp_job_run``, shared with test_torchft_job.py and test_hsdp.py): the periodic saves are written in
    the background by replica 0 ('saving ... in the background', then 'saved' once complete, on the
    manifest the world and the mesh); the run restarted from the asynchronous step-2 checkpoint (the
    later ones removed) repeats the losses bit for bit and ends with the same weights and optimizer
    state."""
    ref, again = hsdp_job_run["out"], str(tmp_path / "again")
    stdout = hsdp_job_run["stdout"]
    assert "HSDP 2 replicas x 2 shard ranks" in stdout
    staged = stdout.index("saving   step 2 in the background (training blocked")
    done = stdout.index("saved    ", staged)
    assert "step_00000002 (" in stdout[done:done + 300] and "in the background)" in stdout[done:done + 300]
    assert [(e["step"], e.get("background")) for e in events(ref) if e["event"] == "save"] == [(2, True), (4, None)]
    step2 = os.path.join(ref, "checkpoints", "step_00000002")
    assert len([f for f in os.listdir(step2) if f.endswith(".distcp")]) == 2  # replica 0's shard group
    with open(os.path.join(step2, "checkpoint.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == 4 and manifest["mesh"] == [2, 2]

    shutil.copytree(ref, again)
    shutil.rmtree(os.path.join(again, "checkpoints", "step_00000004"))
    q = run_job(HSDP_JOB_ARGS + ["--resume", "--out", again], 4)
    assert [e["checkpoint"] for e in events(again) if e["event"] == "resume"] == [
        os.path.join(again, "checkpoints", "step_00000002")], q.stdout[-2000:]
    assert losses(again) == losses(ref) and len(losses(ref)) == 4
    last = [_training_state(os.path.join(d, "checkpoints", "step_00000004"), tmp_path) for d in (ref, again)]
    assert set(last[0]) == set(last[1]) and any(k.startswith("optim.") for k in last[0])
    for k, v in last[0].items():
        assert torch.equal(v, last[1][k]) if isinstance(v, torch.Tensor) else v == last[1][k], k
