"""A tiny run of every benchmark script, so none of them can rot; and the checks those runs make
possible: every engine trains the same model identically (fp32, same data), yafsdp's memory is
flat from step 2 on, the overlap timeline has both lanes.
"""
import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from job_utils import Lanes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--preset", "tiny", "--batch", "2", "--seq", "16"]


def _run(script, *args, timeout=300, env=None):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out.stdout


# The benchmark runs of this module's CPU tests: name -> (the test that reads it, script, its arguments given
# the run's own folder, timeout), the longest first. The ``runs`` fixture starts those of the selected tests
# at the first of them, two at a time (job_utils.Lanes), and each test reads its runs' output.
RUNS = {
    "grad_quant": ("test_bench_grad_quant_small", "bench_grad_quant.py", lambda d: [
        "--preset", "tiny", "--steps", "2", "--tail", "1", "--margin", "10", "--train", "int8, node 2",
        "--out", str(d / "runs"), "--md", str(d / "gq.md")], 600),
    "hsdp": ("test_bench_hsdp_and_the_byte_model", "bench_hsdp.py", lambda d: [
        *TINY, "--accum", "2", "--warmup", "1", "--steps", "1", "--json", str(d / "h.json")], 300),
    "hsdp_bytes": ("test_bench_hsdp_and_the_byte_model", "model_scaling.py", lambda d: [
        "--preset", "tiny", "--param-dtype", "fp32", "--grad-accum", "2", "--bytes", "2x2,1x4"], 300),
    "data": ("test_bench_data_small", "bench_data.py", lambda d: [
        "--sizes", "0.0002", "--kinds", "parquet", "--loader-seconds", "0.3", "--dir", str(d), "--out",
        str(d / "r.md")], 300),
    "step": ("test_bench_step_cpu", "bench_step.py", lambda d: [
        *TINY, "--warmup", "0", "--steps", "3", "--mem-steps", "2", "--phases", "--json", str(d / "step.json"),
        "--md", str(d / "step.md")], 300),
    "finetune": ("test_bench_finetune_cpu", "bench_finetune.py", lambda d: [
        "--preset", "tiny", "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "0", "--mem-steps", "2",
        "--engines", "yafsdp-lora,yafsdp-lora+offload,fsdp2-lora", "--json", str(d / "ft.json")], 300),
    "io": ("test_bench_io_small", "bench_io.py", lambda d: [
        "--small", "--rows", "export,old_export", "--dir", str(d / "io"), "--json", str(d / "io.json")], 300),
    "scaling": ("test_model_scaling", "model_scaling.py", lambda d: [
        "--json", str(d / "s.json"), "--png", str(d / "s.png"), "--worlds", "8,16,64"], 300),
    "scaling_measured": ("test_model_scaling", "model_scaling.py", lambda d: [
        "--compute", "measure", *TINY, "--worlds", "8", "--json", str(d / "m.json"), "--png", ""], 300),
    "world1": ("test_bench_world1_cpu", "bench_world1.py", lambda d: [
        *TINY, "--layers", "2", "--configs", "fp32-full,bf16-lora", "--md", str(d / "w1.md")], 300),
    "rounds": ("test_bench_step_rounds_paired_and_prefetch2", "bench_step.py", lambda d: [
        *TINY, "--layers", "4", "--engines", "yafsdp-z3,yafsdp-z3+prefetch2,ddp", "--interleave", "round",
        "--rounds", "2", "--warmup", "1", "--steps", "2", "--mem-steps", "0", "--json", str(d / "rounds.json")], 300),
    "overlap": ("test_bench_overlap_cpu", "bench_overlap.py", lambda d: [
        *TINY, "--warmup", "1", "--steps", "1", "--png", str(d / "o.png"), "--json", str(d / "o.json"),
        "--trace-dir", str(d / "traces")], 300),
    "ckpt": ("test_bench_ckpt_cpu", "bench_ckpt.py", lambda d: [
        *TINY, "--hidden", "0", "--intermediate", "0", "--layers", "0", "--rounds", "1", "--steps", "1",
        "--root", str(d / "ck"), "--md", str(d / "r.md")], 300),
    "fake_worlds": ("test_bench_step_fake_worlds", "bench_step.py", lambda d: [
        *TINY, "--fake-world", "8,64", "--engines", "yafsdp-z3,fsdp2", "--json", str(d / "fake.json")], 300),
    "cpu_gap": ("test_cpu_gap", "cpu_gap.py", lambda d: [
        *TINY, "--warmup", "1", "--steps", "2", "--engines", "yafsdp-z3,ddp", "--json", str(d / "gap.json")], 300),
    "host_overhead": ("test_host_overhead", "host_overhead.py", lambda d: [
        "--layers", "2", "--steps", "2", "--rounds", "1"], 300),
}


class Runs:
    """The started runs: ``text(name)`` waits for one and gives its stdout (or raises its failure);
    ``dir(name)`` is its folder."""

    def __init__(self, lanes: Lanes, dirs: dict):
        self.lanes, self.dirs = lanes, dirs

    def text(self, name: str) -> str:
        return self.lanes.result(name)

    def dir(self, name: str):
        return self.dirs[name]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    selected = {item.originalname for item in request.session.items}
    base = tmp_path_factory.mktemp("bench")
    lanes, dirs = Lanes(), {}
    for name, (test, script, args, timeout) in RUNS.items():
        if test in selected:
            dirs[name] = d = base / name
            d.mkdir()
            lanes.start(name, _run, script, *args(d), timeout=timeout)
    yield Runs(lanes, dirs)
    lanes.close()


def test_bench_step_cpu(runs):
    text, d = runs.text("step"), runs.dir("step")
    j, md = d / "step.json", d / "step.md"
    assert "x FSDP2" in text and md.read_text().count("|") > 20
    assert "paired by step (3 steps" in text, text  # each engine's step ratio taken within each rotation
    r = json.loads(j.read_text())
    rows = {row["engine"]: row for row in r["rows"]}
    assert {"yafsdp-z3", "yafsdp-z2", "fsdp2", "fsdp1", "ddp"} <= set(rows)
    assert rows["fsdp2"]["vs_fsdp2"] == 1.0 and rows["ddp"]["vs_ddp"] == 1.0
    for name, row in rows.items():
        assert len(row["times_ms"]) == 3 and all(t > 0 for t in row["times_ms"])
        assert row["peak_mib"] > 0
        # Same init, data and optimizer in fp32: every engine's loss sequence matches DDP's.
        # (This is what caught torch's fused AdamW not bumping parameter versions.)
        # (+fp8: the decoder weights are quantize-dequantized in forward; close, not equal.)
        tol = 2e-2 if name.endswith("+fp8") else 1e-4
        for a, b in zip(row["losses"], rows["ddp"]["losses"]):
            assert abs(a - b) <= tol * abs(b), (name, row["losses"], rows["ddp"]["losses"])
    assert rows["yafsdp-z3"]["plan_mib"] > 0
    # FP8 gathers: the engine counts fewer bytes gathered per step (the decoder layers at ~1.03 B/element)
    assert 0 < rows["yafsdp-z3+fp8"]["gathered_mib"] < 0.8 * rows["yafsdp-z3"]["gathered_mib"]
    assert rows["yafsdp-z3+FusedAdamW+fp8"]["gathered_mib"] == rows["yafsdp-z3+fp8"]["gathered_mib"]
    assert len(r["goals"]) == 2 and all("ratio" in g for g in r["goals"])
    # The per-step ratio spread behind each goal, and the machine's noise.
    assert "spread: yafsdp-z3 / ddp per interleaved step" in text and "own spread (max - min over median)" in text
    sp = r["noise"]["ratios"]["yafsdp-z3/ddp"]
    assert sp["min"] <= sp["median"] <= sp["max"] and sp["steps"] == 3
    assert ("NOISE WARNING" in text) == r["noise"]["busy"]
    # --phases: forward, backward and optimizer per measured step; on one rank they add up to its step
    # time, so the sum of each phase's slowest rank is at least the step's slowest rank.
    assert "phases (medians over the measured steps" in text
    for name, row in rows.items():
        ph = r["phases"][name]
        assert len(ph) == 3 and all(len(s) == 3 and min(s) > 0 for s in ph)
        assert all(sum(s) >= 1e-3 * t - 1e-9 for s, t in zip(ph, row["times_ms"]))


def test_bench_ckpt_cpu(runs):
    text = runs.text("ckpt")
    assert "async blocked / sync blocked =" in text and "staging copy" in text
    assert not os.path.exists(runs.dir("ckpt") / "ck")  # the checkpoints are removed


def test_bench_step_noise_report():
    """[Note: noise]: quiet competitors and an idle machine give no warning; a competitor whose own
    step times spread by 40% (or a loaded machine) does, with the values."""
    from yafsdp.measure import noise_report

    goals = [dict(engine="yafsdp-z3", vs="ddp", ratio=1.0, limit=1.1, met=True)]
    quiet = {"yafsdp-z3": [1.00, 1.02, 1.01, 1.05], "ddp": [1.00, 1.01, 0.99, 1.00]}
    lines, info = noise_report(quiet, goals, True, 0.5, 2)
    assert not info["busy"] and not any("NOISE" in x for x in lines)
    r = info["ratios"]["yafsdp-z3/ddp"]  # per-step ratios 1.0, 1.0099, 1.0202, 1.05
    assert (r["min"], r["max"], r["steps"]) == (1.0, 1.05, 4) and r["median"] == pytest.approx((1.02 / 1.01 + 1.01 / 0.99) / 2)
    assert "range x1.000-1.050 over 4 steps" in lines[0]
    busy = {"yafsdp-z3": [1.0, 1.3, 1.1, 1.0], "ddp": [1.0, 1.4, 1.0, 1.0]}
    lines, info = noise_report(busy, goals, True, 0.5, 2)
    assert info["busy"] and "NOISE WARNING" in lines[-1] and "ddp 40% (> 20%)" in lines[-1]
    lines, info = noise_report(quiet, goals, True, 3.1, 2)
    assert info["busy"] and "load average was 3.10 on 2 cores" in lines[-1]


def test_bench_step_fake_worlds(runs):
    text, j = runs.text("fake_worlds"), runs.dir("fake_worlds") / "fake.json"
    r = json.loads(j.read_text())
    assert r["flat"] is True, text
    peak = {(row["world"], row["engine"]): row["peak_mib"] for row in r["rows"]}
    assert set(peak) == {(w, e) for w in (8, 64) for e in ("yafsdp-z3", "fsdp2")}
    assert peak[(64, "yafsdp-z3")] < peak[(8, "yafsdp-z3")]
    for row in r["rows"]:
        if row["engine"].startswith("yafsdp"):
            assert row["growth_bytes"] == 0
            # The state the engine and optimizer hold between steps is what the plan says.
            assert abs(row["step_end"][-1] / 2**20 - row["plan_engine_mib"]) < 0.01


def test_bench_overlap_cpu(runs):
    runs.text("overlap")
    d = runs.dir("overlap")
    png, j, traces = d / "o.png", d / "o.json", d / "traces"
    assert 0 < png.stat().st_size < 300_000
    r = json.loads(j.read_text())
    for name in ("yafsdp-z3", "fsdp2"):
        s = r["summary"][name]
        assert s["gathers"] >= 1 and s["reduces"] >= 1
        assert 0.0 <= s["exposed_fraction"] <= 1.0 and s["step_ms"] > s["exposed_ms"] >= 0
        step = r["steps"][name][-1]
        assert step["compute"] and step["comm"]
    kinds = {(c["kind"], c["unit"]) for c in r["steps"]["yafsdp-z3"][-1]["comm"]}
    assert ("gather", "model.layers.0") in kinds and ("reduce", "model.layers.0") in kinds
    view = r["engine_view"]["yafsdp-z3"][-1]
    assert {iv["kind"] for iv in view["intervals"]} >= {"gather", "reduce", "forward", "backward"}
    with gzip.open(traces / "yafsdp-z3_cpu_rank0.json.gz", "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert any(n.startswith("yafsdp.gather ") for n in names) and any(n.startswith("gloo:") for n in names)


def test_model_scaling(runs):
    text, d = runs.text("scaling"), runs.dir("scaling")
    j, png = d / "s.json", d / "s.png"
    r = json.loads(j.read_text())
    assert r["table"] in text
    rows = {row["world"]: row for row in r["rows"]}
    for row in rows.values():
        for k in ("yafsdp", "fsdp2"):
            assert row[k]["step"] >= row[k]["compute"] > 0 and 0 <= row[k]["exposed"] <= row[k]["comm"]
    assert rows[16]["yafsdp"]["comm"] > rows[8]["yafsdp"]["comm"]  # the ring leaves the node
    for row in rows.values():  # FP8 gathers: ~half the gathered bytes, never a slower predicted step
        assert row["yafsdp_fp8"]["bytes"]["gather"] < 0.6 * row["yafsdp"]["bytes"]["gather"]
        assert row["yafsdp_fp8"]["step"] <= row["yafsdp"]["step"] * 1.001
    # HSDP rows (8-GPU shard groups for llama3-8b): overlapped beats full sharding once the ring would
    # leave the node, deferred pays its all-reduce in full; none at 8 (one replica)
    assert "hsdp" not in rows[8] and r["hsdp_shard"] == 8
    for w in (16, 64):
        h, hd, y = rows[w]["hsdp"], rows[w]["hsdp_deferred"], rows[w]["yafsdp"]
        assert h["replicas"] == w // 8 and h["bytes"]["all_reduce"] > 0
        assert h["step"] < y["step"] and h["step"] < hd["step"], (w, h["step"], hd["step"], y["step"])
    assert r["hsdp_table"] in text
    assert png.stat().st_size < 300_000
    # The default compute is the committed H200 measurement of llama3-8b at 1 x 8192 (not FLOPs)
    assert r["compute"]["source"].startswith("measured on NVIDIA"), r["compute"]["source"]
    assert r["compute"]["source"].endswith(", llama3-8b, batch 1 x seq 8192")
    runs.text("scaling_measured")
    r = json.loads((runs.dir("scaling_measured") / "m.json").read_text())
    assert r["compute"]["layer"][0] > 0 and r["rows"][0]["yafsdp"]["step"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_benchmarks_gpu(tmp_path):
    j = tmp_path / "g.json"
    _run("bench_step.py", "--device", "cuda", *TINY, "--warmup", "1", "--steps", "2", "--mem-steps", "2",
         "--json", str(j))
    rows = {row["engine"]: row for row in json.loads(j.read_text())["rows"]}
    assert rows["yafsdp-z3"]["reserved_mib"] > 0 and rows["yafsdp-z3"]["growth_bytes"] == 0
    _run("bench_step.py", "--device", "cuda", *TINY, "--fake-world", "8", "--json", str(j))
    assert json.loads(j.read_text())["flat"] is True
    _run("bench_overlap.py", "--device", "cuda", *TINY, "--warmup", "1", "--steps", "1", "--json", str(j),
         "--png", str(tmp_path / "o.png"), "--trace-dir", str(tmp_path / "t"))
    r = json.loads(j.read_text())
    assert r["engine_view"]["yafsdp-z3"][-1]["intervals"]


def test_host_overhead(runs):
    text = runs.text("host_overhead")
    assert "ms/step (best of 1 rounds of 2; 5 flat units)" in text and os.path.join(ROOT, "yafsdp") in text


def test_cpu_gap(runs):
    """benchmarks/cpu_gap.py: every engine with its collectives and with local stand-ins; the waits it
    times are the engine's (nonzero with a peer, nothing to wait for without one)."""
    text, j = runs.text("cpu_gap"), runs.dir("cpu_gap") / "gap.json"
    assert "yafsdp-z3 against ddp: wall" in text and "communication (comm - local wall)" in text
    rows = json.loads(j.read_text())["rows"]
    y, d = rows["yafsdp-z3"], rows["ddp"]
    assert y["comm"]["waited_gather"] > 0 and y["comm"]["waited_reduce"] > 0
    assert y["local"]["waited_gather"] < y["comm"]["waited_gather"]
    assert y["local"]["waited_reduce"] < y["comm"]["waited_reduce"]
    for r in (y["comm"], y["local"], d["comm"], d["local"]):
        assert r["wall"] > 0 and 0 < r["main_cpu"] <= r["process_cpu"] + 0.5  # (clocks read apart)
        assert r["forward_cpu"] > 0 and r["backward_cpu"] > 0
    assert d["comm"]["waited_gather"] == 0 and d["comm"]["waited_reduce"] == 0  # DDP waits on none of them


def test_bench_hsdp_and_the_byte_model(runs):
    """benchmarks/bench_hsdp.py at world 4 (full sharding 1 x 4, HSDP 2 x 2): the all-reduce across replicas
    once per step of 2 backward passes, overlapped (one per unit) and deferred (one), the same elements;
    none for full sharding. And benchmarks/model_scaling.py's per-step bytes (gathers, reduce-scatters, the all-reduce across
    replicas) equal what the engine put into its collectives in that run, on every rank."""
    text, j, scaling = runs.text("hsdp"), runs.dir("hsdp") / "h.json", runs.text("hsdp_bytes")
    r = json.loads(j.read_text())
    assert r["table"] in text
    full, over, deferred = (r["per_step"][k][0] for k in ("full", "hsdp", "hsdp-deferred"))
    assert full["all_reduces"] == 0 and deferred["all_reduces"] == 1 and over["all_reduces"] > 1
    assert over["elements"] == deferred["elements"] > 0
    predicted = json.loads(scaling.strip().splitlines()[-1])
    for rank, counted in enumerate(r["bytes"]):
        assert counted["full"] == predicted["1x4"]["overlapped"], (rank, counted, predicted)
        assert counted["hsdp"] == predicted["2x2"]["overlapped"], (rank, counted, predicted)
        assert counted["hsdp-deferred"] == predicted["2x2"]["deferred"], (rank, counted, predicted)
    assert predicted["2x2"]["overlapped"]["all_reduce"] > 0 == predicted["1x4"]["overlapped"]["all_reduce"]


def test_bench_grad_quant_small(runs):
    """benchmarks/bench_grad_quant.py with the tiny preset: the bytes per link from the engine's counters (the
    quantized reduce sends less across node groups than the plain one) and one short run of the job."""
    text, md = runs.text("grad_quant"), runs.dir("grad_quant") / "gq.md"
    rows = {}
    for r in text.splitlines():  # the bytes table first (the convergence table repeats a name)
        if r.startswith("| "):
            rows.setdefault(r.split("|")[1].strip(), r.split("|"))
    assert float(rows["int8, node 2"][4]) < float(rows["fp32 reduce"][4]) / 4  # gradients across node groups
    assert float(rows["HSDP 2x2, int8"][4]) < float(rows["HSDP 2x2"][4]) / 3
    assert "| int8, node 2" in md.read_text() and "within margin" in md.read_text()


def test_bench_finetune_cpu(runs):
    """bench_finetune.py at world 2 on the tiny preset: LoRA under yafsdp with and without offload and under
    FSDP2, interleaved; every engine trains the same PEFT model to the same loss; the frozen base's NF4
    gather is <= 0.30x the bf16 one."""
    text, j = runs.text("finetune"), runs.dir("finetune") / "ft.json"
    r = json.loads(j.read_text())
    assert set(r["times_ms"]) == {"yafsdp-lora", "yafsdp-lora+offload", "fsdp2-lora"}, text
    last = {n: v[-1] for n, v in r["losses"].items()}
    assert last["yafsdp-lora"] == last["yafsdp-lora+offload"]  # offload is bit for bit the same
    assert abs(last["yafsdp-lora"] - last["fsdp2-lora"]) <= 1e-4 * abs(last["fsdp2-lora"])
    assert r["gathered"]["ratio"] <= 0.30
    plan = r["plans"]["yafsdp-lora+offload"]
    assert plan["host_total"] > 0 and plan["placement"]["master"] == "host"


def test_bench_io_small(runs):
    """bench_io.py at the tiny size, one row (load + streamed export + the old export): the table,
    the goals with their verdicts, and nothing left in the folder but the made checkpoint."""
    text, d = runs.text("io"), runs.dir("io")
    j = d / "io.json"
    assert "load_hf_weights" in text and "export_hf (streaming)" in text and "goals (a rank holds its slices" in text
    assert "export writer: growth" in text and "load throughput" in text
    r = json.loads(j.read_text())
    assert r["checkpoint"]["files"] >= 3 and len(r["results"]["export"]) == 2
    assert all(m["seconds"] > 0 for m in r["results"]["load"])
    assert sorted(os.listdir(d / "io")) == ["ckpt_tiny", "result_load.json"]


def test_model_scaling_finds_only_a_matching_measurement(monkeypatch):
    """``--compute auto`` uses a committed GPU measurement only for its own preset, micro-batch and
    sequence length (another shape's layer times would be silently wrong): FLOPs otherwise."""
    import importlib.util

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its own imports (_common)
    spec = importlib.util.spec_from_file_location("model_scaling", os.path.join(ROOT, "benchmarks", "model_scaling.py"))
    ms = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "model_scaling", ms)  # (its dataclasses look themselves up there)
    spec.loader.exec_module(ms)
    for preset in ("llama3-8b", "llama3-70b"):
        path = ms.committed_measurement(preset, 1, 8192)
        assert path and ms.load_compute(path)["source"].endswith(f", {preset}, batch 1 x seq 8192"), path
    assert ms.committed_measurement("llama3-8b", 1, 4096) is None
    assert ms.committed_measurement("llama3-8b", 2, 8192) is None
    assert ms.committed_measurement("llama3-1b", 1, 8192) is None
    assert ms.measured_shape("measured on NVIDIA H200, llama3-8b, batch 1 x seq 8192") == ("llama3-8b", 1, 8192)
    assert ms.measured_shape("FLOPs at 45% of 989 TFLOP/s") is None
    # A file named on the command line is used, and refused where it was measured for another shape
    path = ms.committed_measurement("llama3-8b", 1, 8192)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "model_scaling.py"), "--seq", "4096",
                          "--compute-json", path, "--worlds", "8", "--png", "", "--json", os.devnull],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "was measured for llama3-8b at batch 1 x seq 8192, not llama3-8b at batch 1 x seq 4096" \
        in out.stderr, out.stderr[-2000:]


def test_bench_world1_cpu(runs):
    """benchmarks/bench_world1.py at a tiny shape: every engine runs (a full model in fp32, LoRA in
    bf16), yafsdp holds its plan's state between steps with no weight buffer (the world-1 alias), and
    the report and its JSON are written."""
    import json

    runs.text("world1")
    md = runs.dir("world1") / "w1.md"
    raw = json.loads((runs.dir("world1") / "w1.json").read_text())
    assert set(raw) == {"fp32-full", "bf16-lora"}
    for cfg, d in raw.items():
        m = d["measured"]
        assert set(m) == {"yafsdp", "plain", "fsdp2"} and all("error" not in v for v in m.values()), (cfg, m)
        held = m["yafsdp"]["step_end"][-1] - d["plan"]["state"]
        assert 0 <= held <= 64 * 16, (cfg, m["yafsdp"], d["plan"])  # + AdamW's scalar step counters
        assert not any(k.startswith("weight") for k in d["plan"]["engine"]), (cfg, d["plan"]["engine"])
    assert md.read_text().count("| yafsdp |") == 2


def test_bench_data_small(runs):
    """bench_data.py on a 0.2 MB parquet folder: one job launch at world 2 and the loader's rate, one table row."""
    text, d = runs.text("data"), runs.dir("data")
    row = [line for line in text.splitlines() if line.startswith("| parquet | 0.0002 |")]
    assert len(row) == 1 and "nan" not in row[0], text
    assert row[0] in open(d / "r.md").read()


def _scaling_modules(monkeypatch):
    """benchmarks/model_scaling.py and benchmarks/scaling_options.py, imported in this process."""
    import importlib.util

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("model_scaling", os.path.join(ROOT, "benchmarks", "model_scaling.py"))
    ms = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "model_scaling", ms)  # (scaling_options imports it by that name)
    spec.loader.exec_module(ms)
    import scaling_options as so

    return ms, so


def test_scaling_options_cost_model(monkeypatch):
    """The two-level network of benchmarks/scaling_options.py: "rail" is model_scaling.Net exactly; qgZ
    sends 1/4 of the fp32 bytes across nodes plus the scales and the same over NVLink; hpZ's backward
    gather has no NIC bytes; the TP collectives stay inside the node."""
    ms, so = _scaling_modules(monkeypatch)
    net = ms.Net(360e9, 48e9, 8, 15e-6, 0.5e-6)
    fab = so.Fabric(360e9, 48e9, 8, 15e-6, 0.5e-6, 2500e9, "rail")
    spread = so.Fabric(360e9, 48e9, 8, 15e-6, 0.5e-6, 2500e9, "spread")
    B = 436_207_616
    for w in (4, 8, 16, 64, 1024):
        k, m = so.layout(w, 8)
        assert abs(fab.ring(B, k, m).seconds - net.time(B, w)) < 1e-12, w
    for r in (2, 16):
        assert abs(fab.all_reduce(B, r).seconds - net.all_reduce(B, r)) < 1e-12
    # a flat ring past a node: "spread" sends 1/8 of "rail"'s NIC bytes and the rest over NVLink
    rail_c, spread_c = fab.ring(B, 8, 16), spread.ring(B, 8, 16)
    assert rail_c.nic == B * 127 / 128 and rail_c.nvlink == 0
    assert spread_c.nic == rail_c.nic / 8 and spread_c.nvlink == rail_c.nic * 7 / 8
    assert spread_c.seconds < rail_c.seconds
    # qgZ: int8 records across nodes are (1 + 4/128) / 4 of the same hierarchical path in fp32; the
    # reduce-scatter inside the node is unchanged (fp32)
    n = 218_112_000
    q, f = fab.hier_reduce(n, 4, 8, 16), fab.hier_reduce(n, 4, 8, 16, wire_bytes=4)
    assert abs(q.nic / f.nic - (1 + 4 / 128) / 4) < 1e-12 and q.nvlink == f.nvlink == n * 4 * 7 / 8
    assert abs(q.nic - n / 8 * 15 / 16 * (1 + 4 / 128)) < 1e-3 and q.extra > 0
    assert q.nic < fab.ring(n * 4, 8, 16).nic / 4 and q.nic < spread.ring(n * 4, 8, 16).nic / 3.5
    qa, fa = fab.quantized_all_reduce(n // 8, 4), fab.all_reduce(n // 8 * 4, 4)
    assert abs(qa.nic / fa.nic - (1 + 4 / 128) / 4) < 1e-12
    # hpZ: backward gather inside the node, forward unchanged (plus the copy it leaves behind)
    sizes = {"u": n}
    hp = so.option_link(fab, so.Option("+hpZ", 128, hp=True), sizes, 4)
    full = so.option_link(fab, so.Option("full", 128), sizes, 4)
    back, fwd = hp("gather", "u", 2 * n, "backward"), hp("gather", "u", 2 * n, "forward")
    assert back.nic == 0 and back.nvlink == 2 * n * 7 / 8
    assert fwd.nic == full("gather", "u", 2 * n, "forward").nic > 0 and fwd.extra > 0
    # within one node a secondary shard changes nothing
    one = so.option_link(fab, so.Option("+hpZ", 8, hp=True), sizes, 4)
    assert one("gather", "u", 2 * n, "forward") == so.option_link(fab, so.Option("full", 8), sizes, 4)(
        "gather", "u", 2 * n, "forward")
    # TP: a layer's 4 + 4 sequence-parallel collectives of the group's [tokens, hidden], over NVLink only
    fw, bw = so.tp_unit_comm(fab, "layer", 8 * 8192, 8192, 8, recompute=False)
    one_bytes = 8 * 8192 * 8192 * 2 * 7 / 8
    assert fw.nic == bw.nic == 0 and fw.nvlink == 4 * one_bytes and bw.nvlink == 4 * one_bytes
    _, bw_rc = so.tp_unit_comm(fab, "layer", 8 * 8192, 8192, 8, recompute=True)
    assert bw_rc.nvlink == 8 * one_bytes
    with pytest.raises(ValueError, match="'ring'"):
        so.Fabric(1, 1, 8, 0, 0, 1, "ring")


def test_scaling_studies(monkeypatch, tmp_path):
    """--study zeropp and --study tp on Llama-3-8B shapes at 16 and 64 GPUs: "full" under "rail" is the
    earlier model's step to the nanosecond; the secondary shard removes exactly the backward gathers
    from the NIC and costs 1/8 of the gathered units in memory; ZeRO++'s three together send under a
    quarter of full sharding's NIC bytes; TP divides the data-parallel bytes by the TP degree."""
    ms, so = _scaling_modules(monkeypatch)
    base = ["--preset", "llama3-8b", "--worlds", "16,64", "--nic-gbit", "400", "--png", str(tmp_path / "z.png"),
            "--json", str(tmp_path / "z.json"), "--md", str(tmp_path / "z.md")]
    r = ms.main(["--study", "zeropp", *base])
    rows = {(x["cross"], x["world"], x["config"]): x for x in r["rows"]}
    assert "## Assumptions" in (tmp_path / "z.md").read_text() and (tmp_path / "z.png").stat().st_size < 300_000
    old = ms.main(["--preset", "llama3-8b", "--worlds", "16,64", "--png", "", "--json", str(tmp_path / "o.json")])
    for row in old["rows"]:
        w = row["world"]
        assert abs(rows[("rail", w, "full")]["step"] - row["yafsdp"]["step"]) < 1e-9, w
        assert abs(rows[("rail", w, "FSDP2-like")]["step"] - row["fsdp2"]["step"]) < 1e-9, w
    p = ms.memory_plan(ms.build_model("llama3-8b"), world_size=64, param_dtype="bf16", reduce_dtype="fp32")
    # the backward gathers of full sharding: every gather but each unit's one in forward (the embedding reads
    # no weights in backward, and the units a buffer still holds when backward starts are not gathered again)
    back = rows[("rail", 64, "full")]["gathered"] - sum(u.gather_bytes for u in p.units)
    assert 0 < back < sum(u.gather_bytes for u in p.units if not u.weight_free_bw)
    for cross in ("rail", "spread"):
        full, hp = rows[(cross, 64, "full")], rows[(cross, 64, "+hpZ")]
        per_gpu = back * 63 / 64 / (8 if cross == "spread" else 1)
        assert abs((full["nic"] - hp["nic"]) - per_gpu) < 1e3, (cross, full["nic"], hp["nic"], per_gpu)
        assert abs(hp["memory"] - full["memory"] - so.secondary_bytes(p.units, 8)) < 1
        # ZeRO++'s three together: under a quarter of the NIC bytes with "rail" (the hierarchy of qgZ counts
        # there too), about the paper's 4x with "spread" (int8 against our fp32 reduce; the paper's int4
        # against fp16)
        assert rows[(cross, 64, "qwZ+hpZ+qgZ")]["nic"] < full["nic"] / (4 if cross == "rail" else 3.5)
        h = rows[(cross, 64, "HSDP")]
        assert h["replicas"] == 8 and h["nic"] == rows[("rail", 64, "HSDP")]["nic"]  # all exact rings
    assert rows[("rail", 64, "qwZ+hpZ+qgZ")]["step"] < rows[("rail", 64, "full")]["step"]
    # TP 8 x DP: each GPU gathers and reduces 1/8 of each unit over a ring of W / 8 GPUs, one per node
    r = ms.main(["--study", "tp", *base[:-6], "--png", "", "--json", str(tmp_path / "t.json")])
    rows = {(x["cross"], x["world"], x["config"]): x for x in r["rows"]}
    for w in (16, 64):
        full, tp = rows[("rail", w, "full sharding")], rows[("rail", w, "TP x yafsdp")]
        dp = w // 8
        expect = full["nic"] / 8 * ((dp - 1) / dp) / ((w - 1) / w)
        assert abs(tp["nic"] / expect - 1) < 1e-4, (w, tp["nic"], expect)
        assert rows[("spread", w, "TP x yafsdp")]["nic"] == tp["nic"]
        assert tp["tp_comm"] > 0 and tp["step"] > rows[("rail", w, "TP x yafsdp, async TP")]["step"]
        assert tp["memory"] < full["memory"]
    with pytest.raises(SystemExit, match=r"whole nodes of 8 GPUs; --worlds has \[12\]"):
        ms.main(["--study", "tp", "--preset", "llama3-8b", "--worlds", "12,16", "--png", "", "--json", os.devnull])


def test_bench_step_rounds_paired_and_prefetch2(runs):
    """Round mode prints each engine's ratios paired within each round; the prefetch=2 engine trains exactly
    as yafsdp-z3 and gathers fewer bytes per step (a third buffer still holds a layer when backward reaches it)."""
    text, j = runs.text("rounds"), runs.dir("rounds") / "rounds.json"
    assert "paired by round (2 rounds" in text, text
    r = json.loads(j.read_text())
    rows = {row["engine"]: row for row in r["rows"]}
    assert rows["yafsdp-z3+prefetch2"]["losses"] == rows["yafsdp-z3"]["losses"]
    assert 0 < rows["yafsdp-z3+prefetch2"]["gathered_mib"] < rows["yafsdp-z3"]["gathered_mib"]
    rounds = r["rounds"]
    assert len(rounds["ddp"]["round_ms"]) == 2 and rounds["ddp"]["ratios"]["ddp"] == [1.0, 1.0]
    assert all(x > 0 for x in rounds["yafsdp-z3+prefetch2"]["ratios"]["yafsdp-z3"])


def test_prefetch_study(monkeypatch, tmp_path):
    """--study prefetch: prefetch=1 is the zeropp study's "full" to the nanosecond; prefetch=2 adds one
    weight buffer of the largest layer and gathers exactly one layer fewer per step (the backward re-gather
    of the unit the third buffer still holds); its step is never longer."""
    ms, so = _scaling_modules(monkeypatch)
    base = ["--preset", "llama3-8b", "--worlds", "8,16,64", "--nic-gbit", "400", "--cross", "rail", "--png", "",
            "--json", str(tmp_path / "p.json"), "--md", str(tmp_path / "p.md")]
    r = ms.main(["--study", "prefetch", *base])
    z = ms.main(["--study", "zeropp", *base[:-2]])
    full = {x["world"]: x for x in z["rows"] if x["config"] == "full"}
    layer = ms.memory_plan(ms.build_model("llama3-8b"), world_size=8, param_dtype="bf16").units[1]
    assert "## Assumptions" in (tmp_path / "p.md").read_text()
    for row in r["rows"]:
        w = row["world"]
        assert abs(row["step"][0] - full[w]["step"]) < 1e-9, w
        assert row["step"][1] <= row["step"][0] + 1e-12, row
        assert row["gathered"][0] - row["gathered"][1] == layer.gather_bytes, row
        assert row["weight_buffers"][1] - row["weight_buffers"][0] == layer.gather_bytes, row
