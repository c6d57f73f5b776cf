"""The CUDA stream protocol, proven on the CPU: the engine's stream schedule runs over the
simulated streams of yafsdp.streamcheck, which log every kernel's stream and buffer accesses and
check that each cross-stream read/overwrite of an engine tensor is ordered by events.

The schedule cases must be race-free; each fault test removes one ordering edge of the schedule
(the bug the checker was built to find among them) and the checker must report it.
"""
import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import Stack, batch, loss_of, tiny_llama
from yafsdp import comm
from yafsdp.comm import collectives
from yafsdp.streamcheck import StreamChecker, StreamProtocolError
from yafsdp.trace import span

# name -> options: kind llama|stack, zero, bf16, opt (fused_adamw | adamw | torch_fused), accum, ckpt,
# tie, vocab (outsized embedding/head), layers, prefetch, eval (a no-grad forward after each step), sd (full/load state
# dict between steps), units (explicit unit list), reduce_bf16, between (a no-grad forward between each
# forward and its backward), retain (each loss backwarded twice, the first with retain_graph).
CASES = {
    "z3_bf16_fusedadamw_tied_eval": dict(zero=3, bf16=True, opt="fused_adamw", tie=True, accum=2, eval=True),
    "z2_bf16_fusedadamw_eval": dict(zero=2, bf16=True, opt="fused_adamw", accum=2, eval=True),
    "z3_fp32_adamw_ckpt": dict(zero=3, opt="adamw", ckpt=True, accum=2),
    "z2_fp32_adamw_ckpt_tied": dict(zero=2, opt="adamw", ckpt=True, tie=True),
    "z3_bf16_torch_fused_outsized": dict(zero=3, bf16=True, opt="torch_fused", vocab=1000, reduce_bf16=True),
    "z3_bf16_fusedadamw_state_dict": dict(zero=3, bf16=True, opt="fused_adamw", sd=True, eval=True),
    "stack_z3_ckpt_units": dict(kind="stack", zero=3, opt="fused_adamw", ckpt=True, units=True),
    # frozen groups: a frozen-only head (released by the node on its inputs), frozen q/k inside the
    # layers (released after both the gate and that node), a frozen norm in the small group
    "z3_bf16_frozen": dict(zero=3, bf16=True, opt="fused_adamw", accum=2, eval=True,
                           freeze=("q_proj", "k_proj", "lm_head", "model.norm")),
    # NF4 groups: frozen mlp and q/k quantized, gathered compact into the staging areas and expanded
    # on the comm stream before `ready` (comm/schedule.py [Note: expanding a compact gather]); ZeRO-3 re-gathers
    # them for backward into the same two buffers, with a state-dict round trip between steps
    "z3_bf16_nf4": dict(zero=3, bf16=True, opt="fused_adamw", accum=2, eval=True, sd=True, nf4=True,
                        freeze=("q_proj", "k_proj", "mlp", "lm_head")),
    # offload (comm/schedule.py [Note: streams and events]): FusedAdamW's copy-out into the host staging and its
    # uploads on the upload stream, the reduced grads' device -> host copies on the comm stream and the
    # host folds at the end of backward (a tied unit reduced twice per backward); with "all" the
    # frozen/NF4 shards copied into the landing before their gathers, and torch AdamW (the cast pass)
    "z3_bf16_offload_fusedadamw_tied": dict(zero=3, bf16=True, opt="fused_adamw", tie=True, accum=2, eval=True,
                                            sd=True, offload="optimizer"),
    "z3_bf16_offload_fusedadamw_touched": dict(zero=3, bf16=True, opt="fused_adamw", offload="optimizer", touch=True),
    "z3_bf16_offload_all_nf4_adamw": dict(zero=3, bf16=True, opt="adamw", accum=2, sd=True, nf4=True,
                                          offload="all", freeze=("q_proj", "k_proj", "mlp", "lm_head")),
    # compact trainable gathers (gather_dtype="fp8", formats/fp8_codec.py): FusedAdamW writes the FP8 records in its
    # pass on the compute stream, the gathers read them on the comm stream after copies-ready, the
    # expand runs before `ready`; ZeRO-2 with torch AdamW (the cast pass quantizes) and a reload
    "z3_bf16_fp8_fusedadamw": dict(zero=3, bf16=True, opt="fused_adamw", accum=2, eval=True, fp8=True),
    "z2_fp32_fp8_adamw_sd": dict(zero=2, opt="adamw", sd=True, fp8=True),
    # offload x fp8 (placement.py): the FP8 records written on the host (FusedAdamW's copy-out, the
    # quantize pass after a reload) and uploaded on the upload stream before copies-ready
    "z3_bf16_fp8_offload_fusedadamw_sd": dict(zero=3, bf16=True, opt="fused_adamw", fp8=True, sd=True,
                                              offload="optimizer"),
    # a no-grad forward between a forward and its backward (with checkpointing: the recompute then
    # re-gathers into buffers the no-grad forward used), and two backward calls over one forward
    # (retain_graph: every unit re-gathered and released again in the second call)
    "z3_bf16_ckpt_between_retain": dict(zero=3, bf16=True, opt="fused_adamw", ckpt=True, between=True, retain=True),
    # bf16 reduce with fp32 accumulation (reduce_accum.py): the all-to-all into the grad buffers'
    # landing and the fp32 sum of the pieces (through the accumulator on the 2nd micro-batch) on the
    # comm stream, before `done`; an outsized head so three grad buffers take turns
    "z3_bf16_reduce_accum_fp32": dict(zero=3, bf16=True, opt="fused_adamw", accum=2, vocab=1000, reduce_bf16=True,
                                      reduce_accum=True, eval=True),
    # INT8 gathers (formats/int8.py): the records written by FusedAdamW / the cast pass (offload: on the
    # host, then uploaded), expanded by the twin's torch ops on the comm stream
    "z3_bf16_int8_fusedadamw": dict(zero=3, bf16=True, opt="fused_adamw", accum=2, eval=True, gather="int8"),
    "z3_bf16_int8_offload_adamw_sd": dict(zero=3, bf16=True, opt="adamw", sd=True, gather="int8", offload="optimizer"),
    # prefetch=2 ([Note: prefetch depth] in engine/runtime.py): three weight buffers in rotation over five
    # layers, each gather issued two units ahead into the buffer released one unit back, in forward, in
    # backward and for the checkpoint recomputes; with an outsized head, offload's uploads and a no-grad
    # forward between forward and backward
    "z3_bf16_prefetch2_ckpt": dict(zero=3, bf16=True, opt="fused_adamw", ckpt=True, accum=2, eval=True, prefetch=2,
                                   layers=5),
    "z3_fp32_prefetch2_outsized_offload": dict(zero=3, opt="adamw", vocab=1000, offload="optimizer", between=True,
                                               prefetch=2, layers=5),
}


def _optimizer(name, params):
    if name == "fused_adamw":
        return yafsdp.FusedAdamW(params, lr=1e-3, weight_decay=0.1)
    if name == "torch_fused":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _build(case):
    kind = case.get("kind", "llama")
    if kind == "llama":
        model = tiny_llama(tie=case.get("tie", False), checkpointing=case.get("ckpt", False),
                           vocab=case.get("vocab", 67), layers=case.get("layers", 3))
        units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
        for name, p in model.named_parameters():
            if any(f in name for f in case.get("freeze", ())):
                p.requires_grad_(False)
    else:
        model = Stack(ckpt=case.get("ckpt", False))
        units = [model.inp, *model.blocks, model.head]
    return kind, model, (units if case.get("units") else None)


def _run_case(rank, case, steps=3):
    """Train ``case`` under a StreamChecker; returns (report, races, kernels checked, losses)."""
    kind, module, units = _build(case)
    with StreamChecker() as chk:
        model = yafsdp.YaFSDP(
            module, units=units, zero_stage=case.get("zero", 3),
            param_dtype=torch.bfloat16 if case.get("bf16") else None,
            reduce_dtype=torch.bfloat16 if case.get("reduce_bf16") else torch.float32,
            reduce_accum_dtype=torch.float32 if case.get("reduce_accum") else None,
            quantize_frozen="nf4" if case.get("nf4") else None, offload=case.get("offload"),
            gather_dtype="fp8" if case.get("fp8") else case.get("gather"), prefetch=case.get("prefetch", 1),
        )
        assert ("fp8" in model.owned_tensors()) == bool(case.get("fp8"))
        assert ("int8" in model.owned_tensors()) == (case.get("gather") == "int8")
        assert isinstance(model.schedule, comm.StreamSchedule)
        assert ("nf4" in model.owned_tensors()) == bool(case.get("nf4"))
        assert ("frozen" in model.owned_tensors() or "nf4" in model.owned_tensors()) == bool(case.get("freeze"))
        opt = _optimizer(case.get("opt", "adamw"), model.parameters())
        chk.watch(model)
        losses = []
        accum = case.get("accum", 1)
        with chk.recording():
            for step in range(steps):
                for micro in range(accum):
                    loss = loss_of(model, kind, batch(kind, step, micro, rank))
                    if case.get("between"):
                        with torch.no_grad():
                            loss_of(model, kind, batch(kind, 200 + step, micro, rank))
                    if case.get("retain"):
                        (loss / accum).backward(retain_graph=True)
                    (loss / accum).backward()
                model.clip_grad_norm_(1.0)
                opt.step()
                if case.get("touch"):  # an in-place change after the step: the cast pass writes every copy again
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.0)
                opt.zero_grad(set_to_none=step % 2 == 0)
                losses.append(loss.item())
                if case.get("eval"):
                    with torch.no_grad():
                        loss_of(model, kind, batch(kind, 100 + step, 0, rank))
                if case.get("sd"):
                    sd = model.full_state_dict()
                    model.load_full_state_dict(sd if rank == 0 else None)
    # Every kernel of a gather or a reduce (the collective, and the fold behind a reduce) runs on
    # the comm stream, and nothing else does.
    kernels = [entry[1:4] for entry in chk.log if entry[0] == "kernel"]  # (stream, op, label)
    comm_labels = ("yafsdp.gather", "yafsdp.reduce", "yafsdp.expand")
    comm_side = [(stream, op, label) for stream, op, label in kernels
                 if label.startswith(comm_labels) or stream == "comm"]
    stray = [k for k in comm_side if k[0] != "comm" or not k[2].startswith(comm_labels)]
    if case.get("offload"):  # uploads ran on their own stream
        assert any(label.startswith("yafsdp.upload") and stream != "comm" and stream != "compute"
                   for stream, op, label in kernels), sorted({k[0] for k in kernels})
    if case.get("nf4"):  # the expand kernel ran, on the comm stream
        assert any(op == "yafsdp.nf4_expand_" and stream == "comm" for stream, op, _ in kernels)
    if case.get("fp8"):  # the records written on the compute stream (offload: the host), expanded on comm
        assert any(op == "yafsdp.fp8_expand_" and stream == "comm" for stream, op, _ in kernels)
        writer = "yafsdp.adamw_step_fp8_" if case.get("opt") == "fused_adamw" else "yafsdp.fp8_quantize_"
        where = "host" if case.get("offload") else "compute"
        assert any(op == writer and stream == where for stream, op, _ in kernels), sorted(
            {(st, op) for st, op, _ in kernels if op == writer})
    if case.get("gather") == "int8":  # the records written by the optimizer (offload: on the host), expanded on comm
        expand = {(stream, op) for stream, op, label in kernels if label.startswith("yafsdp.expand")}
        assert ("comm", "aten.copy_") in expand and {st for st, _ in expand} == {"comm"}, sorted(expand)
        where = "host" if case.get("offload") else "compute"
        writer = "Optimizer.step#FusedAdamW" if case.get("opt") == "fused_adamw" else "yafsdp.quantize"
        assert any(op == "aten.copy_" and stream == where and label.startswith(writer)
                   for stream, op, label in kernels), sorted({(st, lab) for st, op, lab in kernels if op == "aten.copy_"})
    if case.get("reduce_accum"):  # the pieces exchanged and summed on the comm stream, the accumulator used
        reduce_ops = {op for stream, op, label in kernels if label.startswith("yafsdp.reduce") and stream == "comm"}
        # the exchange (world 1: the own row's copy), the fp32 sum of the rows, a fresh fold's scale, and
        # the 2nd micro-batch's add through the accumulator
        more = {"c10d.recv_", "c10d.send", "aten.add_"} if torch.distributed.get_world_size() > 1 else set()
        assert more | {"aten.copy_", "aten.mul_", "yafsdp.accumulate_"} <= reduce_ops, reduce_ops
        assert "grad0_accum" in model.owned_tensors() and "_accum" in " ".join(
            n for entry in chk.log if entry[0] == "kernel" for n, *_ in entry[5]), "the accumulator was never written"
    from yafsdp.layout import sizing

    aliased = torch.distributed.get_world_size() == 1 and sizing.ALIAS_WORLD1  # may gather nothing at all
    assert (aliased or any(op.startswith("c10d.") for _, op, _ in comm_side)) and not stray, stray[:5]
    return chk.report(), [str(r) for r in chk.races], chk.kernels, losses


def _cases(rank, world, names):
    return {name: _run_case(rank, CASES[name]) for name in names}


def test_schedule_cases_are_race_free_world2():
    results = run_ranks(_cases, 2, list(CASES))
    for rank, per_case in enumerate(results):
        for name, (report, races, kernels, losses) in per_case.items():
            assert not races, f"rank {rank}, case {name}:\n{report}"
            assert kernels > 100, f"case {name}: only {kernels} kernels touched engine tensors"
            assert all(torch.isfinite(torch.tensor(losses))), (name, losses)


def test_world1_alias_is_race_free():
    """[Note: the world-1 alias]: at world 1 the units without a compact group read their shards
    themselves (no gather, no buffer); the compute copy the optimizer's copy-out and the cast pass
    write is then read by the forward directly, on the compute stream. Every case without offload
    (offload keeps the buffers) is race-free and trains as before."""
    names = [n for n, c in CASES.items() if not c.get("offload")]
    (per_case,) = run_ranks(_cases, 1, names)
    for name, (report, races, kernels, losses) in per_case.items():
        assert not races, f"case {name}:\n{report}"
        assert kernels > 0 and all(torch.isfinite(torch.tensor(losses))), (name, kernels, losses)


# ---------------------------------------------------------------------------------- faults
def _drop_edge(edge: str):
    """Remove one ordering edge from the stream schedule (for the fault tests)."""
    if edge == "copies_written_once":  # the bug this checker was built to find: the copies-ready
        orig = comm.StreamSchedule.copies_written  # point recorded only at the first cast

        def once(self):
            if not getattr(self, "_fault_seen", False):
                self._fault_seen = True
                orig(self)

        comm.StreamSchedule.copies_written = once
    elif edge == "released":
        comm.StreamSchedule.released = lambda self, sync: None
    elif edge == "taken":  # a world-1 buffer's memory taken, the gather's writes not ordered after it
        comm.StreamSchedule.taken = lambda self, sync: None
    elif edge == "wait_gathered":
        comm.StreamSchedule.wait_gathered = lambda self, sync: None
    elif edge == "wait_reduced":
        comm.StreamSchedule.wait_reduced = lambda self, sync: None
    elif edge == "expand_after_ready":  # the NF4 expand issued after the gather's `ready` point
        orig_gather = comm.StreamSchedule.gather

        def gather(self, sync, out, shard, unit, expand=None):
            orig_gather(self, sync, out, shard, unit)
            if expand is not None:
                with self.streams.use(self.comm), span("expand", unit):
                    expand()

        comm.StreamSchedule.gather = gather
    elif edge == "upload_unordered":  # offload: the copies-ready point recorded on the compute stream only
        def copies_written(self):
            self.copies_ready.record(self.streams.current_stream())

        comm.StreamSchedule.copies_written = copies_written
    elif edge == "wait_uploads":  # offload: the host writes the staging an upload may still read
        comm.StreamSchedule.wait_uploads = lambda self: None
    elif edge == "host_fold_early":  # offload: the host folds without waiting for the grads to land
        orig_finish = comm.StreamSchedule.finish_host_folds

        def finish(self):
            for landed, _ in self.host_pending:
                landed.synchronize = lambda: None
            orig_finish(self)

        comm.StreamSchedule.finish_host_folds = finish
    else:
        raise ValueError(edge)


FAULTS = {
    # fault -> (case, the tensor and the kernels the race must name)
    "copies_written_once": (dict(zero=3, bf16=True, opt="fused_adamw", tie=True), "compute_copy",
                            ("yafsdp.adamw_step_", "c10d._allgather_base_")),
    "released": (dict(zero=3, opt="adamw"), "weight", ("c10d._allgather_base_",)),
    "wait_gathered": (dict(zero=3, opt="adamw"), "weight", ("c10d._allgather_base_",)),
    "wait_reduced": (dict(zero=3, opt="adamw", accum=2), "grad", ("c10d.reduce_scatter",)),
    "expand_after_ready": (dict(zero=3, bf16=True, opt="adamw", nf4=True, freeze=("mlp",)), "weight",
                           ("yafsdp.nf4_expand_",)),
    "upload_unordered": (dict(zero=3, bf16=True, opt="fused_adamw", offload="optimizer"), "compute_copy",
                         ("aten.copy_", "c10d._allgather_base_")),
    "host_fold_early": (dict(zero=3, bf16=True, opt="adamw", offload="optimizer"), "grad_landing",
                        ("aten.copy_",)),
    "wait_uploads": (dict(zero=3, bf16=True, opt="fused_adamw", offload="optimizer", touch=True), "compute_host",
                     ("yafsdp.cast_", "aten.copy_")),
    # the FP8 records FusedAdamW writes are read by the next gathers without the copies-ready point
    "fp8_copies_written_once": (dict(zero=3, bf16=True, opt="fused_adamw", fp8=True), "fp8",
                                ("yafsdp.adamw_step_fp8_", "c10d._allgather_base_")),
    "fp8_expand_after_ready": (dict(zero=3, bf16=True, opt="adamw", fp8=True), "weight", ("yafsdp.fp8_expand_",)),
    # fp32 accumulation: the next micro-batch's grad writes race the exchange of the pieces (the
    # all-to-all's own slice is a copy at world 1) and the fp32 fold writes the grad shard unordered
    "accum_wait_reduced": (dict(zero=3, bf16=True, opt="adamw", accum=2, reduce_bf16=True, reduce_accum=True),
                           "grad", ("aten.copy_",)),
    # prefetch=2: a gather two units ahead overwrites the buffer the unit before the computing one still reads
    "prefetch2_released": (dict(zero=3, opt="adamw", prefetch=2, layers=5), "weight", ("c10d._allgather_base_",)),
}


def _faulty(edge: str, case: dict) -> list[str]:
    """The races of ``case`` trained with ``edge`` dropped; the schedule's class is restored after."""
    cls = comm.StreamSchedule
    before = dict(vars(cls))
    _drop_edge(edge)
    try:
        return _run_case(0, case)[1]
    finally:
        for name in set(vars(cls)) | set(before):
            if name not in before:
                delattr(cls, name)
            elif vars(cls).get(name) is not before[name]:
                setattr(cls, name, before[name])


def _every_fault(rank, world):
    """Every fault of FAULTS and the ZeRO-2 bug, in one spawned rank (one start-up instead of eleven);
    a clean case last checks that the restores left no edge dropped. fault -> races, or the error."""
    from yafsdp.layout import sizing

    # One rank, every unit gathered into a weight buffer as at any world (without the switch, world 1
    # aliases the shards and gathers nothing: [Note: the world-1 alias]; test_world1_alias_is_race_free).
    sizing.ALIAS_WORLD1 = False
    out = {}
    runs = [(f, f.split("_", 1)[1] if f.startswith(("fp8_", "accum_", "prefetch2_")) else f, FAULTS[f][0])
            for f in FAULTS]
    runs.append(("zero2_bug", "copies_written_once", dict(zero=2, bf16=True, opt="fused_adamw")))
    # [Note: the world-1 cast gather] (the alias switch on): the gathers cast the fp32 master the optimizer wrote
    runs.append(("cast_copies_written_once", "copies_written_once", dict(zero=3, bf16=True, opt="fused_adamw", tie=True)))
    # [Note: world-1 records in place]: the expand reads the fp8 records FusedAdamW writes, where they lie
    runs.append(("inplace_fp8_copies_written_once", "copies_written_once",
                 dict(zero=3, bf16=True, opt="fused_adamw", fp8=True)))
    # [Note: world-1 buffers in use only]: a buffer's memory taken from the allocator on the compute stream
    runs.append(("inuse_taken", "taken", dict(zero=3, bf16=True, opt="fused_adamw", tie=True)))
    for name, edge, case in runs:
        sizing.ALIAS_WORLD1 = name.startswith(("cast_", "inplace_", "inuse_"))
        # the copies-ready faults with buffers held for the run: a taken point would order them as well
        sizing.IN_USE_WORLD1 = name.startswith("inuse_")
        try:
            out[name] = _faulty(edge, case)
        except Exception as e:  # reported by the test of that fault
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            sizing.ALIAS_WORLD1, sizing.IN_USE_WORLD1 = False, True
    out["clean"] = _run_case(0, CASES["z3_bf16_fusedadamw_tied_eval"])[1]
    return out


@pytest.fixture(scope="module")
def fault_races():
    """name -> the races of that faulty run; a run that raised fails the test that asks for it."""
    every = run_ranks(_every_fault, 1)[0]

    def races(name: str) -> list[str]:
        assert isinstance(every[name], list), f"{name}: the faulty run raised: {every[name]}"
        return every[name]
    return races


@pytest.mark.parametrize("fault", list(FAULTS))
def test_checker_reports_a_dropped_edge(fault, fault_races):
    races = fault_races(fault)
    _, tensor, ops = FAULTS[fault]
    assert races, f"dropping {fault!r} went unnoticed"
    assert any(r.startswith(f"race on '{tensor}") and all(op in r for op in ops) for r in races), races


def test_checker_reports_an_unordered_world1_cast_gather(fault_races):
    """[Note: the world-1 cast gather]: at world 1 the gathers of the units without a compute copy cast
    the fp32 master on the comm stream; without the copies-ready point they read it while FusedAdamW
    writes it."""
    races = fault_races("cast_copies_written_once")
    assert any(r.startswith("race on 'master") and "yafsdp.adamw_step_" in r and "aten.copy_" in r
               for r in races), races


def test_checker_reports_an_unordered_world1_expand_in_place(fault_races):
    """[Note: world-1 records in place]: at world 1 the fp8 records expand into the buffer from the store
    FusedAdamW writes; without the copies-ready point the expand reads them while they are written."""
    races = fault_races("inplace_fp8_copies_written_once")
    assert any(r.startswith("race on 'fp8") and "yafsdp.adamw_step_fp8_" in r and "yafsdp.fp8_expand_" in r
               for r in races), races


def test_checker_reports_a_world1_buffer_taken_unordered(fault_races):
    """[Note: world-1 buffers in use only]: at world 1 a weight buffer's memory is taken from the allocator
    on the compute stream at its gather; without the taken point the gather writes it on the comm stream
    while the compute stream's earlier work may still use the block ([Note: a storage's memory coming and
    going] in streamcheck.py)."""
    races = fault_races("inuse_taken")
    assert any(r.startswith("race on 'weight") and "allocator.resize_" in r and "stream 'comm'" in r
               for r in races), races


def test_faults_leave_the_schedule_as_it_was(fault_races):
    """The fault runs share one process: after the last, a schedule case is race-free again."""
    assert fault_races("clean") == []


def test_checker_reports_the_fused_adamw_race_under_zero2(fault_races):
    races = fault_races("zero2_bug")
    # ZeRO-2 re-gathers every unit after a step with nothing but the copies-ready point to wait on.
    assert len({r.split(" in yafsdp.gather ")[1].split(" ")[0] for r in races if " in yafsdp.gather " in r}) >= 3, races


def test_checker_sees_a_plain_race_and_its_fix():
    chk = StreamChecker()
    side = chk.new_stream(priority=-1)
    buf = torch.zeros(8)
    chk.watch({"buf": buf})
    with chk.recording():
        buf.add_(1)  # compute stream writes
        with chk.use(side):
            buf.sum()  # side stream reads, unordered
    assert len(chk.races) == 1 and "read by aten.sum" in str(chk.races[0])
    with pytest.raises(StreamProtocolError, match="1 race"):
        chk.assert_ordered()
    chk2 = StreamChecker()
    side = chk2.new_stream()
    chk2.watch({"buf": buf})
    with chk2.recording():
        buf.add_(1)
        ev = chk2.new_event()
        ev.record()
        with chk2.use(side):
            side.wait_event(ev)
            buf[4:].sum()
        buf[:4].mul_(2)  # the side stream reads only [4:): no overlap, no race
    chk2.assert_ordered()
    assert chk2.kernels == 3


# ---------------------------------------------------------------------------------- HSDP
def _hsdp_case(rank, world, fault):
    """World 4 as a 2x2 mesh under the checker: accumulation 2 over 4 steps (the first defers the
    all-reduce across replicas to clipping, the later ones overlap it with their last backward; step
    3 is mispredicted into 1 backward call, step 4 back to 2: repaired), ZeRO-3 bf16 FusedAdamW tied."""
    from torch.distributed.device_mesh import init_device_mesh

    if fault == "replicated":  # the compute side no longer waits for the deferred all-reduce
        def replicate(self, grad, unit):
            self.grads_final.record(self.streams.current_stream())
            with self.streams.use(self.comm):
                self.comm.wait_event(self.grads_final)
                collectives.all_reduce(grad, self.replicate_group, async_op=False)

        comm.StreamSchedule.replicate = replicate
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kind, module, _ = _build(dict(tie=True))
    with StreamChecker() as chk:
        model = yafsdp.YaFSDP(module, mesh=mesh, param_dtype=torch.bfloat16)
        opt = _optimizer("fused_adamw", model.parameters())
        chk.watch(model)
        with chk.recording():
            for step, accum in enumerate((2, 2, 1, 2)):
                for micro in range(accum):
                    (loss_of(model, kind, batch(kind, step, micro, rank)) / accum).backward()
                model.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
    kernels = [entry[1:4] for entry in chk.log if entry[0] == "kernel"]
    all_reduces = [(stream, label) for stream, op, label in kernels if op == "c10d.allreduce_"
                   and label.startswith("yafsdp.all_reduce")]
    return [str(r) for r in chk.races], all_reduces, model._rt.replica_sync.stats


def _hsdp_cases(rank, world):
    return [_hsdp_case(rank, world, None), _hsdp_case(rank, world, "replicated")]  # the fault last: it patches


def test_hsdp_schedule_is_race_free_and_a_dropped_wait_is_reported():
    for rank, (clean, faulty) in enumerate(run_ranks(_hsdp_cases, 4)):
        races, all_reduces, stats = clean
        assert not races, f"rank {rank}:\n" + "\n".join(races[:5])
        # every all-reduce across replicas ran on the comm stream, deferred ones and overlapped ones
        assert all_reduces and {s for s, _ in all_reduces} == {"comm"}, all_reduces[:5]
        assert stats["overlapped"] > 0 and stats["deferred"] > 0 and stats["rescaled"] > 0, stats
        assert any(r.startswith("race on 'grad") and "c10d.allreduce_" in r for r in faulty[0]), faulty[0][:5]


def _record_two_steps(chk, model, kind: str, rank: int) -> None:
    """Two steps of two micro-batches (clipped, fused AdamW) recorded by ``chk``, which watches ``model``."""
    opt = _optimizer("fused_adamw", model.parameters())
    chk.watch(model)
    with chk.recording():
        for step in range(2):
            for micro in range(2):
                (loss_of(model, kind, batch(kind, step, micro, rank)) / 2).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()


def _hsdp_offload_case(rank, world, fault):
    """offload x HSDP (world 2 as 2 replicas of one rank) under the checker: the host grad shards'
    all-reduce staged through an idle grad buffer ([Note: the all-reduce of host grad shards] in
    yafsdp/engine/placement.py): the copy in and out on the compute stream, the all-reduce on the comm stream."""
    from torch.distributed.device_mesh import init_device_mesh

    if fault == "replicated":  # the compute side no longer waits for the all-reduce before copying back
        def replicate(self, grad, unit):
            self.grads_final.record(self.streams.current_stream())
            with self.streams.use(self.comm):
                self.comm.wait_event(self.grads_final)
                collectives.all_reduce(grad, self.replicate_group, async_op=False)

        comm.StreamSchedule.replicate = replicate
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    kind, module, _ = _build(dict(tie=True))
    with StreamChecker() as chk:
        model = yafsdp.YaFSDP(module, mesh=mesh, param_dtype=torch.bfloat16, offload="optimizer")
        _record_two_steps(chk, model, kind, rank)
    kernels = [entry[1:4] for entry in chk.log if entry[0] == "kernel"]
    all_reduces = [stream for stream, op, label in kernels if op == "c10d.allreduce_"
                   and label.startswith("yafsdp.all_reduce")]
    return [str(r) for r in chk.races], all_reduces, dict(model._rt.replica_sync.stats)


def _hsdp_offload_cases(rank, world):
    return [_hsdp_offload_case(rank, world, None), _hsdp_offload_case(rank, world, "replicated")]


def test_hsdp_offload_staging_is_race_free_and_a_dropped_wait_is_reported():
    for rank, (clean, faulty) in enumerate(run_ranks(_hsdp_offload_cases, 2)):
        races, all_reduces, stats = clean
        assert not races, f"rank {rank}:\n" + "\n".join(races[:5])
        assert all_reduces and set(all_reduces) == {"comm"}, all_reduces[:5]
        assert stats["deferred"] > 0 and stats["overlapped"] == 0, stats
        # without the wait, the copy back to the host reads the staging the all-reduce writes
        assert any(r.startswith("race on 'grad") and "c10d.allreduce_" in r for r in faulty[0]), faulty[0][:5]


def test_span_labels_only_for_a_listener(monkeypatch):
    """trace.span opens a record_function label only under a profiler or a dispatch mode (what this
    checker reads); otherwise none: see [Note: labels only for a listener] in trace.py."""
    from torch.utils._python_dispatch import TorchDispatchMode

    opened = []
    real = torch.profiler.record_function

    def counting(label):
        opened.append(label)
        return real(label)

    monkeypatch.setattr(torch.profiler, "record_function", counting)
    with span("gather", "u0"):
        torch.ones(2).add_(1)
    assert opened == []

    class Labels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Labels(), span("reduce", "u1"):
        torch.ones(2).add_(1)
    with torch.profiler.profile() as prof, span("gather", "u2"):
        torch.ones(2).add_(1)
    assert opened == ["yafsdp.reduce u1", "yafsdp.gather u2"]
    assert any(e.name == "yafsdp.gather u2" for e in prof.events())


# ---------------------------------------------------------------------------------- the secondary shard
def _secondary_case(rank, world, fault):
    """World 4 in groups of 2 (``secondary_shard=2``, [Note: the secondary shard] in engine/secondary.py)
    under the checker: int8 records kept behind each forward gather and gathered within the pair for
    backward and for the checkpoint recomputes, bf16, FusedAdamW, accumulation 2. ``fault``: the piece
    copied on the compute stream, which does not wait for the gather's ``ready``."""
    from yafsdp.engine.secondary import SecondaryShard

    kind, module, _ = _build(dict(ckpt=True))
    with StreamChecker() as chk:
        model = yafsdp.YaFSDP(module, param_dtype=torch.bfloat16, gather_dtype="int8", secondary_shard=2)
        if fault:
            streams = model.schedule.streams

            def keeper(self, piece, gathered, then=None):
                compute = streams.current_stream()  # the host issues the gather from the compute side
                n = piece.numel()
                part = gathered[self.index * n:(self.index + 1) * n]

                def keep():
                    with streams.use(compute):
                        piece.copy_(part)
                    if then is not None:
                        then()

                return keep

            SecondaryShard.keeper = keeper
        _record_two_steps(chk, model, kind, rank)
    kernels = [entry for entry in chk.log if entry[0] == "kernel"]
    on_secondary = {(e[1], e[3].split("#")[0]) for e in kernels if any(n == "secondary" for n, *_ in e[4] + e[5])}
    return [str(r) for r in chk.races], sorted(on_secondary), dict(model.schedule.counted)


def _secondary_cases(rank, world):
    return [_secondary_case(rank, world, False), _secondary_case(rank, world, True)]  # the fault last: it patches


def test_secondary_shard_is_race_free_and_a_piece_kept_off_the_comm_stream_is_reported():
    for rank, (clean, faulty) in enumerate(run_ranks(_secondary_cases, 4)):
        races, on_secondary, counted = clean
        assert not races, f"rank {rank}:\n" + "\n".join(races[:5])
        # the store is written behind the whole-group gathers and read by the pair's, on the comm stream only
        assert on_secondary and {s for s, _ in on_secondary} == {"comm"}, on_secondary
        assert any(kind == "secondary_gather" for kind, _ in counted), counted
        # the copy reads the gathered records before the comm stream's gather is known to have written them
        assert any(r.startswith("race on 'weight") for r in faulty[0]), faulty[0][:5]
