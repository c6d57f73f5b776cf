"""Streaming loads: ``yafsdp.hf.load_hf_weights`` reads only each rank's slices, and
``yafsdp.peft_load`` builds PEFT / QLoRA models whose base is never materialized.

- parity: the streamed shards equal those of the old path (rank 0 reads the whole checkpoint,
  ``load_full_state_dict`` scatters it), torch.equal on every stored shard, for a single-file and
  a sharded checkpoint (with its index, as HF writes them), stored bf16 / fp16 / fp32, world 2
  and HSDP 2x1, a plain model and one with frozen, NF4 and FP8-gathered groups;
- the bound: the bytes the loader holds (``export.LEDGER``) stay within this rank's shards +
  1.2 x the largest unit (fp32) + a constant, while the old path's whole-checkpoint read does not;
- refusals: a missing, unexpected, misshapen key or a broken index raise on every rank and leave
  every shard as it was; so does a checkpoint only rank 1 finds wrong;
- PEFT: adapters over a meta base equal those of ``from_pretrained`` + ``get_peft_model`` with the
  same seed, and the wrapped models compute equal losses before and after a step (LoRA and QLoRA).
"""
import json
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from models import tiny_llama

LAYERS = 6


def _frozen_kinds(model):
    """Freeze every other layer: frozen + NF4 groups there (quantize_frozen="nf4"), trainable FP8 elsewhere."""
    for i, layer in enumerate(model.model.layers):
        if i % 2:
            layer.requires_grad_(False)
    model.model.embed_tokens.requires_grad_(False)
    return model


def _write(sd: dict, folder: str, dtype: torch.dtype, files: int) -> str:
    """``sd`` as an HF safetensors checkpoint of ``files`` files (more than one: with the index)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tiny_llama(layers=LAYERS).config.save_pretrained(folder)
    sd = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    if files == 1:
        save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return folder
    keys = list(sd)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: sd[k] for k in keys[i::files]}
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return folder


def _shards(model):
    return [s.tensor.clone() for s in model._rt.stored_shards()]


def _build(mesh, kinds: bool):
    import yafsdp
    from yafsdp.init import meta_parameters

    with meta_parameters():
        m = tiny_llama(layers=LAYERS)
    if kinds:
        return yafsdp.YaFSDP(_frozen_kinds(m), mesh=mesh, quantize_frozen="nf4", gather_dtype="fp8")
    return yafsdp.YaFSDP(m, mesh=mesh)


def _stream_ranks(rank, world, ckpts, bad):
    from torch.distributed.device_mesh import init_device_mesh

    from yafsdp.export import LEDGER
    from yafsdp.hf import HFCheckpointError, load_hf_weights, read_hf_state_dict

    meshes = {"flat": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))}
    out = {"parity": {}, "refused": {}, "bound": {}}
    for how, mesh in meshes.items():
        for kinds in (False, True):
            for name, path in ckpts.items():
                old = _build(mesh, kinds)
                old.load_full_state_dict(read_hf_state_dict(path) if dist.get_rank() == 0 else None)
                new = _build(mesh, kinds)
                load_hf_weights(new, path)
                a, b = _shards(old), _shards(new)
                out["parity"][(how, kinds, name)] = (len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)),
                                                     new.needs_load, sorted({g.kind.name for u in new._rt.all
                                                                             for g in u.groups}))
            # refusals: every rank raises, no shard changes
            for case, path in bad.items():
                if case == "rank1_only":  # only rank 1 is given the broken checkpoint
                    path = path if dist.get_rank() == 1 else ckpts["single_fp32"]
                before = _shards(new)
                try:
                    load_hf_weights(new, path)
                    msg = None
                except HFCheckpointError as e:
                    msg = str(e)
                out["refused"][(how, kinds, case)] = (msg, all(torch.equal(x, y) for x, y in zip(before, _shards(new))))
            del old, new
    # the bound: this rank's shards + 1.2 x the largest unit (fp32) + a constant
    for kinds in (False, True):
        model = _build(meshes["flat"], kinds)
        own = sum(s.tensor.numel() * s.tensor.element_size() for s in model._rt.stored_shards())
        unit = max(sum(g.layout.padded_numel for g in u.groups) * 4 for u in model._rt.all)
        bound = own + 1.2 * unit + 4096
        results = {}
        for path_name in ("sharded_bf16", "single_fp32"):
            LEDGER.reset()
            load_hf_weights(model, ckpts[path_name])
            results[path_name] = LEDGER.peak
        # the old path, counted the same way: rank 0 holds the whole checkpoint
        import safetensors.torch as st

        load_file = st.load_file
        st.load_file = lambda *a, **k: {n: LEDGER.hold(t) for n, t in load_file(*a, **k).items()}
        try:
            LEDGER.reset()
            sd = read_hf_state_dict(ckpts["single_fp32"]) if dist.get_rank() == 0 else None
            model.load_full_state_dict(sd)
            del sd
            results["old"] = LEDGER.peak
        finally:
            st.load_file = load_file
        out["bound"][kinds] = dict(results, bound=bound, now=LEDGER.now,
                                   plan=model.memory_plan().load_host)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_stream")
    model = tiny_llama(layers=LAYERS, seed=7)
    sd = model.state_dict()
    ckpts = {"single_fp32": _write(sd, str(base / "single_fp32"), torch.float32, 1),
             "sharded_bf16": _write(sd, str(base / "sharded_bf16"), torch.bfloat16, 3),
             "single_fp16": _write(sd, str(base / "single_fp16"), torch.float16, 1)}
    missing = dict(sd)
    del missing["model.layers.2.mlp.up_proj.weight"]
    shape = dict(sd, **{"model.layers.4.self_attn.o_proj.weight": torch.zeros(32, 31)})
    bad = {"missing": _write(missing, str(base / "missing"), torch.bfloat16, 2),
           "unexpected": _write(dict(sd, **{"model.layers.9.extra": torch.zeros(3)}), str(base / "unexpected"),
                                torch.float32, 1),
           "misshapen": _write(shape, str(base / "misshapen"), torch.float32, 1),
           "integer": _write(dict(sd, **{"model.norm.weight": torch.ones(32, dtype=torch.int32)}), str(base / "int"),
                             torch.float32, 1),
           "index_wrong": _write(sd, str(base / "index_wrong"), torch.float32, 2)}
    from safetensors.torch import save_file

    save_file({k: (v.int() if k == "model.norm.weight" else v.float().contiguous()) for k, v in sd.items()},
              os.path.join(bad["integer"], "model.safetensors"))
    idx = os.path.join(bad["index_wrong"], "model.safetensors.index.json")
    j = json.load(open(idx))
    wm = j["weight_map"]
    wm["model.norm.weight"] = next(f for f in set(wm.values()) if f != wm["model.norm.weight"])  # the other file
    json.dump(j, open(idx, "w"))
    bad["rank1_only"] = bad["misshapen"]
    nan = dict(sd, **{NAN_KEY: sd[NAN_KEY].clone()})
    nan[NAN_KEY].view(-1)[-1] = float("nan")  # the last element: in the last rank's shard only
    ckpts["nan"] = _write(nan, str(base / "nan"), torch.float32, 1)
    return ckpts, bad


NAN_KEY = f"model.layers.{LAYERS - 1}.mlp.down_proj.weight"


def _nan_ranks(rank, world, path):
    """A NaN in a tensor only rank 1's slice holds: every rank raises, naming the file and the tensor."""
    import yafsdp
    from yafsdp.hf import HFCheckpointError, load_hf_weights

    model = yafsdp.YaFSDP(tiny_llama(layers=LAYERS, seed=0))
    try:
        load_hf_weights(model, path)
    except HFCheckpointError as e:
        return str(e)
    return None


def _all_ranks(rank, world, ckpts, bad):
    """One process group for every multi-rank case of this file (a spawn costs more than the cases)."""
    return dict(_stream_ranks(rank, world, {k: v for k, v in ckpts.items() if k != "nan"}, bad),
                peft=_peft_ranks(rank, world, ckpts["sharded_bf16"]), nan=_nan_ranks(rank, world, ckpts["nan"]))


@pytest.fixture(scope="module")
def streamed(checkpoints):
    return run_ranks(_all_ranks, 2, *checkpoints)


def test_streaming_load_equals_rank0_load(streamed):
    """Every stored shard bit-equal to the old path's, for every checkpoint layout and stored dtype,
    flat and HSDP 2x1, plain and frozen/NF4/FP8 groups."""
    for rank, res in enumerate(streamed):
        assert len(res["parity"]) == 12
        for key, (equal, needs_load, kinds) in res["parity"].items():
            assert equal and not needs_load, (rank, key)
            want = ["frozen", "nf4", "trainable"] if key[1] else ["trainable"]
            assert kinds == want, (key, kinds)


def test_streaming_load_refusals_on_every_rank(streamed):
    want = {"missing": "model.layers.2.mlp.up_proj.weight", "unexpected": "model.layers.9.extra",
            "misshapen": "model.layers.4.self_attn.o_proj.weight' has shape (32, 31)",
            "integer": "'model.norm.weight' is stored as I32", "index_wrong": "does not match its files",
            "rank1_only": "model.layers.4.self_attn.o_proj.weight' has shape (32, 31)"}
    for rank, res in enumerate(streamed):
        assert len(res["refused"]) == 4 * len(want)
        for (how, kinds, case), (msg, unchanged) in res["refused"].items():
            assert msg is not None and want[case] in msg, (rank, how, kinds, case, msg)
            assert unchanged, (rank, how, kinds, case)


def test_streaming_load_names_a_tensor_holding_nan_on_every_rank(streamed, checkpoints):
    """HF weights with a NaN where only rank 1 reads it: both ranks raise the same error naming the file
    and the tensor (found on the data the load reads anyway), none trains on it."""
    path = os.path.join(checkpoints[0]["nan"], "model.safetensors")
    for rank, res in enumerate(streamed):
        assert res["nan"] is not None, rank
        assert f"{path!r}, tensor {NAN_KEY!r} holds NaN/inf" in res["nan"], (rank, res["nan"])
        assert "load again from finite weights" in res["nan"], res["nan"]


def test_streaming_load_holds_one_slice_at_a_time(streamed):
    """The loader's held bytes stay within own shards + 1.2 x the largest unit + 4 KiB, and within the
    plan's "host at load" row; the old path (rank 0 reads every file whole) is over that bound on
    rank 0, so the count can tell."""
    for rank, res in enumerate(streamed):
        for kinds, r in res["bound"].items():
            assert 0 < r["sharded_bf16"] <= r["bound"] and 0 < r["single_fp32"] <= r["bound"], (rank, kinds, r)
            assert r["now"] == 0, r  # everything the loader took is freed
            # what `python -m yafsdp plan` says the load adds ("host at load") covers what was held
            assert max(r["sharded_bf16"], r["single_fp32"]) <= r["plan"] < r["bound"], (rank, kinds, r)
            if rank == 0:
                assert r["old"] > r["bound"], (kinds, r)


# ---------------------------------------------------------------------------- PEFT over a meta base
def _peft_ranks(rank, world, path):
    import peft
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    import yafsdp
    from yafsdp.hf import read_hf_config
    from yafsdp.peft_load import load_peft_base, meta_peft_model

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                               task_type="CAUSAL_LM")

    ids = torch.randint(0, 67, (2, 9), generator=torch.Generator().manual_seed(rank))
    meshes = {"flat": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))}
    out = {}
    for how, quant in (("flat", None), ("flat", "nf4"), ("hsdp", "nf4")):
        models, adapters = [], []
        for meta in (False, True):
            if meta:
                built = meta_peft_model(read_hf_config(path), lora(), seed=11, attn_implementation="eager",
                                        dtype=torch.float32)
                inner = built.model
            else:
                base = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
                torch.manual_seed(11)
                inner = peft.get_peft_model(base, lora())
            adapters.append({k: v.detach().clone() for k, v in inner.state_dict().items() if "lora_" in k})
            m = yafsdp.YaFSDP(inner, mesh=meshes[how], quantize_frozen=quant)
            if meta:
                assert m.needs_load
                load_peft_base(m, path, built.adapters)
            models.append(m)
        losses = []
        for m in models:
            opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            run = []
            for _ in range(2):
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                run.append(loss.item())
            losses.append(run)
        a, b = adapters
        shards = [_shards(m) for m in models]
        out[(how, quant)] = dict(adapters=a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
                                 n=len(a), b_zero=all(not v.any() for k, v in b.items() if "lora_B" in k),
                                 losses=losses, shards=all(torch.equal(x, y) for x, y in zip(*shards)))
    return out


def test_peft_over_meta_base_equals_materialized(streamed):
    """LoRA and QLoRA (NF4 base, flat and HSDP 2x1): the meta-base path's adapters equal PEFT's over a
    from_pretrained base for the same seed (A kaiming-uniform, B zero), every stored shard is equal,
    and the losses are equal before and after an AdamW step."""
    for rank, res in enumerate(r["peft"] for r in streamed):
        assert len(res) == 3
        for key, r in res.items():
            assert r["adapters"] and r["n"] == 2 * 3 * LAYERS and r["b_zero"], (rank, key, r)
            assert r["shards"], (rank, key)
            assert r["losses"][0] == r["losses"][1], (rank, key, r["losses"])


def test_peft_meta_refuses_weight_derived_inits():
    import peft

    from yafsdp.peft_load import meta_peft_model

    cfg = tiny_llama(layers=1).config
    for kw, what in ((dict(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
                     (dict(use_dora=True), "use_dora=True")):
        with pytest.raises(ValueError, match=what):
            meta_peft_model(cfg, peft.LoraConfig(r=2, target_modules=["q_proj"], **kw))


def test_plan_reports_host_memory_per_phase():
    """The plan's host memory per rank at load, in training and at export (a user sizes
    the host by it): the host-resident state (offload), + the streaming loader's peak, + the writer's chunks."""
    from yafsdp.export import CHUNK_BYTES
    from yafsdp.plan import memory_plan

    model = tiny_llama(layers=2)
    for offload in (None, "all"):
        plan = memory_plan(model, world_size=2, param_dtype=torch.bfloat16, offload=offload)
        h = plan.host_phases()
        assert h["training"] == plan.host_total and (h["training"] > 0) == (offload is not None), (offload, h)
        assert h["load"] == plan.host_total + plan.load_host > h["training"], (offload, h)
        assert h["export"] == plan.host_total + 2 * CHUNK_BYTES, (offload, h)
        assert (f"at load {h['load'] / 2**30:.3f} GiB, training {h['training'] / 2**30:.3f} GiB, "
                f"export {h['export'] / 2**30:.3f} GiB") in plan.format()
        assert plan.to_dict()["host_phases"] == h
