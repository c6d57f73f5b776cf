"""Streaming HF export (yafsdp/integrations/export.py, hf_export.py): HF's sharded layout that
``from_pretrained`` loads with equal weights (fp32 and bf16, the run's dtype as default), the
writer's held bytes within one output shard + the largest unit + a constant (counted by the
writer's ledger, not RSS), the merged export and the adapter streamed the same way, and a failed
write that leaves no export folder. One world-2 process group runs every case."""
import json
import os

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import tiny_llama

peft = pytest.importorskip("peft")

SHARD = 12_000  # bytes: the tiny Llama's ~60 KB of fp32 weights make several files


def _unit_bytes(model) -> int:
    """The largest unit's gathered bytes (every flat group, padded, in the shards' dtype)."""
    return max(sum(g.layout.padded_numel * g.shard.element_size() for g in u.groups) for u in model._rt.all)


def _lora(rank):
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                               lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # PEFT's B starts at zero: make the merge change the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _cases(rank, world, root):
    from yafsdp.export import LEDGER, ExportError, ShardWriter
    from yafsdp.hf import export_hf

    out = {}
    model = yafsdp.YaFSDP(tiny_llama(tie=True))
    out["sd"] = model.full_state_dict()
    out["units"] = [sorted(u) for u in model.iter_full_state_dict()]
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        LEDGER.reset()
        before = LEDGER.now
        export_hf(model, os.path.join(root, name), dtype=dtype, max_shard_size=SHARD)
        out[f"peak_{name}"] = LEDGER.peak - before
    out["unit_bytes"] = _unit_bytes(model)
    from yafsdp.plan import memory_plan

    out["plan_export_unit"] = memory_plan(model).export_unit  # what `python -m yafsdp plan` reports

    # a write that fails on rank 0 in the middle: raised on every rank, nothing left behind; until
    # the final rename there is no folder under the export's name (so a kill leaves none either)
    target = os.path.join(root, "failed")
    real, seen = ShardWriter.write, []

    def failing(self, key, t, via=None):
        seen.append(os.path.exists(target))
        if len(seen) == 5:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, key, t, via)

    ShardWriter.write = failing
    try:
        with pytest.raises(ExportError, match="No space left"):
            export_hf(model, target, max_shard_size=SHARD)
    finally:
        ShardWriter.write = real
    out["failed_left"] = sorted(n for n in os.listdir(root) if n.startswith("failed"))
    out["seen_target"] = any(seen)
    export_hf(model, target, max_shard_size=SHARD)  # the next export succeeds in its place
    # into a folder that is not empty (that export): refused on every rank before anything is gathered, the
    # files kept (it was raised on rank 0 only, at the final rename, after the whole model had been streamed)
    kept = {n: os.path.getsize(os.path.join(target, n)) for n in os.listdir(target)}
    try:
        export_hf(model, target, max_shard_size=SHARD)
        out["nonempty"] = ""
    except ExportError as e:
        out["nonempty"] = str(e)
    out["nonempty_kept"] = kept == {n: os.path.getsize(os.path.join(target, n)) for n in os.listdir(target)}

    # the run's dtype is the default: a bf16 run exports bf16
    bf = yafsdp.YaFSDP(tiny_llama(seed=2), param_dtype=torch.bfloat16)
    out["sd_bf_run"] = bf.full_state_dict()
    export_hf(bf, os.path.join(root, "bf_run"), max_shard_size="15KB")

    lora = yafsdp.YaFSDP(_lora(rank))
    out["lora_sd"] = lora.full_state_dict()
    LEDGER.reset()
    before = LEDGER.now
    yafsdp.adapters.export_merged(lora, os.path.join(root, "merged"), max_shard_size=SHARD)
    out["peak_merged"] = LEDGER.peak - before
    out["lora_unit_bytes"] = _unit_bytes(lora)
    lora.save_adapter(os.path.join(root, "adapter"))
    return out if rank == 0 else {"nonempty": out["nonempty"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("export"))
    r0, r1 = run_ranks(_cases, 2, root)
    r0["nonempty_rank1"] = r1["nonempty"]
    return r0, root


def _files(path):
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


def test_sharded_export_loads_with_equal_weights(results):
    from transformers import LlamaForCausalLM

    r, root = results
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        path = os.path.join(root, name)
        files = _files(path)
        assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        assert sorted(set(index["weight_map"].values())) == files
        assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as save_pretrained does
        assert all(os.path.getsize(os.path.join(path, f)) <= SHARD + 4096 for f in files)  # + the header
        hf, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True, dtype=dtype)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        got = hf.state_dict()
        for k, v in r["sd"].items():
            assert got[k].dtype == dtype and torch.equal(got[k], v.to(dtype)), (name, k)
    # the run's default dtype: bf16
    hf = LlamaForCausalLM.from_pretrained(os.path.join(root, "bf_run"))
    assert hf.dtype == torch.bfloat16 and len(_files(os.path.join(root, "bf_run"))) >= 3
    got = hf.state_dict()
    for k, v in r["sd_bf_run"].items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
    # the stream is the state dict, unit by unit
    assert sorted(k for u in r["units"] for k in u) == sorted(r["sd"])


def test_writer_holds_one_unit_not_the_model(results):
    """The ledger counts every tensor the writing rank holds for the export while it lives."""
    from yafsdp.export import CHUNK_BYTES

    r, _ = results
    total = sum(v.numel() * 4 for v in r["sd"].values())
    largest_tensor = max(v.numel() * 4 for v in r["sd"].values())
    bound = SHARD + r["unit_bytes"] + min(CHUNK_BYTES, largest_tensor)  # the constant: one converted chunk
    assert r["plan_export_unit"] == r["unit_bytes"]
    assert 0 < r["peak_fp32"] <= bound and 0 < r["peak_bf16"] <= bound, (r["peak_fp32"], r["peak_bf16"], bound)
    assert total > bound + largest_tensor  # holding the whole model (or one more unit) would fail this
    merged_bound = SHARD + r["lora_unit_bytes"] + largest_tensor  # the constant: a merged weight and its delta
    assert 0 < r["peak_merged"] <= merged_bound < sum(v.numel() * 4 for v in r["lora_sd"].values())


def test_failed_write_leaves_no_export(results):
    from transformers import LlamaForCausalLM

    r, root = results
    assert r["failed_left"] == [] and r["seen_target"] is False
    hf = LlamaForCausalLM.from_pretrained(os.path.join(root, "failed"))
    assert torch.equal(hf.state_dict()["model.norm.weight"], r["sd"]["model.norm.weight"])


def test_export_into_a_folder_with_files_is_refused_on_every_rank(results):
    r, root = results
    target = os.path.join(root, "failed")
    for msg in (r["nonempty"], r["nonempty_rank1"]):
        assert f"yafsdp.hf.export_hf: {target!r} exists and is not empty" in msg, msg
    assert r["nonempty_kept"]


def test_merged_export_and_adapter(results):
    from transformers import LlamaForCausalLM

    r, root = results
    sd = r["lora_sd"]
    path = os.path.join(root, "merged")
    assert len(_files(path)) >= 3
    hf = LlamaForCausalLM.from_pretrained(path)
    got = hf.state_dict()
    merged = 0
    for k, v in got.items():
        lk = "base_model.model." + k
        base = lk.replace(".weight", ".base_layer.weight")
        if base in sd:
            a, b = sd[lk.replace(".weight", ".lora_A.default.weight")], sd[lk.replace(".weight", ".lora_B.default.weight")]
            assert torch.allclose(v, sd[base] + 2.0 * (b @ a), atol=1e-6, rtol=0), k  # alpha / r = 2
            assert not torch.equal(v, sd[base])
            merged += 1
        else:
            assert torch.equal(v, sd[lk]), k
    assert merged == 6  # q_proj, v_proj of 3 layers
    # the adapter, streamed: PEFT loads it with the trained values
    model = peft.PeftModel.from_pretrained(tiny_llama(seed=5), os.path.join(root, "adapter"))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == 12
    for k, v in loaded.items():
        assert torch.equal(v, sd[k]), k


def test_parse_size_and_writer_plan(tmp_path):
    from safetensors.torch import load_file

    from yafsdp.export import ExportError, ShardWriter, parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 5 * 10**8
    assert parse_size("10KiB") == 10240 and parse_size(123) == 123 and parse_size("8Kb") == 1000
    for bad in ("5 parsecs", 0, -3, "", True, 1.5):
        with pytest.raises(ExportError, match="max_shard_size"):
            parse_size(bad)
    ts = {"a": torch.arange(10.0), "big": torch.randn(7, 9), "i": torch.arange(3), "c": torch.randn(2)}
    plan = [(k, tuple(v.shape), torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in ts.items()]
    w = ShardWriter(str(tmp_path), plan, 100)  # "big" (126 B) is larger than a file: a file of its own
    assert w.names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with pytest.raises(ExportError, match="'big' written where the plan has 'a'"):
        w.write("big", ts["big"])
    for k, v in ts.items():
        w.write(k, v)
    w.close()
    got = {}
    for n in w.names:
        got.update(load_file(str(tmp_path / n)))
    for k, v in ts.items():
        assert got[k].dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype)
        assert torch.equal(got[k], v.to(got[k].dtype)), k
