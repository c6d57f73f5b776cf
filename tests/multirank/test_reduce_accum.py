"""reduce_dtype=bf16 with reduce_accum_dtype=fp32: bf16 pieces on the wire, summed in fp32.

See [Note: narrow reduce, fp32 accumulation] in yafsdp/comm/reduce_accum.py. The error against the fp32
reduce stays within one bf16 rounding per contribution on inputs that cancel across ranks (where
the bf16 reduce's running sum does not), and a short training run matches a one-process reference
that rounds each rank's contribution to bf16 and sums in fp32.
"""
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import yafsdp
from dist_utils import hsdp_groups, run_ranks
from models import Stack, batch, loss_of, tiny_llama
from parity import rel_l2, rel_seq
from yafsdp.comm.reduce_accum import check_reduce_accum, error_bound, fold_pieces_, fold_pieces_reference

BF16 = torch.bfloat16


def test_fold_kernel_is_its_twin_and_options_are_checked():
    g = torch.Generator().manual_seed(0)
    for world, n in ((1, 7), (3, 257), (4, 17)):
        pieces = (torch.randn(world, n, generator=g) * 100).to(BF16)
        base = torch.randn(n, generator=g)
        for accumulate in (False, True):
            want = fold_pieces_reference(base.clone(), pieces, 1 / 3, accumulate)
            got = fold_pieces_(base.clone(), pieces, 1 / 3, accumulate, torch.empty(n))
            assert torch.equal(got, want), (world, n, accumulate)
    assert check_reduce_accum(None, BF16) is None
    assert check_reduce_accum(torch.float32, BF16) is torch.float32
    assert check_reduce_accum(torch.float32, torch.float32) is None  # fp32 reduces already sum in fp32
    with pytest.raises(ValueError, match="reduce_accum_dtype=torch.float64"):
        check_reduce_accum(torch.float64, BF16)
    with pytest.raises(ValueError, match="offload='optimizer'"):
        check_reduce_accum(torch.float32, BF16, "optimizer")


# ------------------------------------------------------------------------ adversarial cancellation
class _Leaf(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, c):
        return (self.w * c).sum()


class Probe(nn.Module):
    """Two units whose gradient on each rank is that rank's chosen contribution ``c``."""

    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList([_Leaf(n), _Leaf(n)])

    def forward(self, c):
        return self.blocks[0](c[0]) + self.blocks[1](c[1])


X = 256.0  # bf16's spacing at X is 2: a bf16 partial sum X + small loses the small value


def contributions(world: int, n: int, seed: int) -> torch.Tensor:
    """(world, n) fp32: per element, +X on one rank and -X on another (every ordered pair of ranks
    in turn, so whatever order a reduce sums in, some elements meet a small value before the
    cancelling one), small values on the others. First half of the elements: every value exact in
    bf16 (and the sum exact in fp32); second half: arbitrary fp32 values (and -X plus a little)."""
    g = torch.Generator().manual_seed(seed)
    small = torch.randint(-128, 128, (world, n), generator=g).float() / 64  # multiples of 2^-6 below 2: exact in bf16
    half = n // 2
    small[:, half:] = torch.randn(world, n - half, generator=g)
    c = small
    pairs = list(itertools.permutations(range(world), 2))
    for j in range(n):
        hi, lo = pairs[j % len(pairs)]
        c[hi, j] = X
        c[lo, j] = -X if j < half else -X + small[lo, j] * 0.01
    return c


def _grads(rank, world, n, seed, **opts):
    """(the full averaged gradient of both blocks, reduce bytes this rank put in) under engine
    options ``opts``; rank ``r``'s gradient is ``contributions(...)[r]``."""
    c = contributions(world, 2 * n, seed)
    model = yafsdp.YaFSDP(Probe(n), **opts)
    model(c[rank].view(2, n)).backward()
    sent = sum(v for (kind, _), v in model.schedule.counted.items() if kind == "reduce")
    return torch.cat([model.full_grad(f"blocks.{i}.w") for i in range(2)]), sent


def _adversarial(rank, world):
    out = {}
    for name, opts in {"fp32": {}, "bf16": dict(reduce_dtype=BF16),
                       "accum": dict(reduce_dtype=BF16, reduce_accum_dtype=torch.float32)}.items():
        out[name] = _grads(rank, world, N, 1, **opts)
    # HSDP, 2 replicas x 2 shards: each replica sums its pieces in fp32, the replicas' fp32 shards are
    # all-reduced in fp32.
    out["hsdp"] = _grads(rank, world, N, 1, process_group=hsdp_groups(2, world // 2), reduce_dtype=BF16,
                         reduce_accum_dtype=torch.float32)
    out["chunked"] = _chunked_vs_own(rank, world)  # the same ranks: test_chunked_outsized_gradients_...
    return out


_WORLD4: list = []


def _world4() -> list:
    """Every rank's results of one world of 4 (shared by the tests that need one)."""
    if not _WORLD4:
        _WORLD4.extend(run_ranks(_adversarial, 4))
    return _WORLD4


N = 37  # per block; uneven, so the flat units are padded


def test_fp32_accumulation_is_within_one_bf16_rounding_where_the_bf16_reduce_is_not():
    world = 4
    res = _world4()
    for r in res[1:]:  # every rank sees the same full gradients
        for k in res[0]:
            if k == "chunked":
                continue
            assert torch.equal(r[k][0], res[0][k][0]), k
    got = {k: v[0] for k, v in res[0].items() if k != "chunked"}
    sent = {k: v[1] for k, v in res[0].items() if k != "chunked"}
    # bf16 bytes on the wire (half of fp32's but for the alignment: 16 bytes per rank is 8 bf16 elements, 4 fp32)
    assert sent["accum"] == sent["bf16"] == 2 * 2 * 48 and sent["fp32"] == 4 * 2 * 40, sent
    c = contributions(world, 2 * N, 1)
    exact = c.double().sum(0) / world
    fp32 = got["fp32"].double()
    fp32_bound = ((world - 1) * c.abs().double().sum(0) / world + exact.abs()) * 2 ** -24
    assert ((fp32 - exact).abs() <= fp32_bound).all()  # the fp32 reduce: fp32 roundings only
    # the fp32-accumulated reduce: each contribution rounded to bf16 once, summed in fp32 in rank order
    want = fold_pieces_reference(torch.zeros(2 * N), c.to(BF16), 1 / world, False)
    assert torch.equal(got["accum"], want)
    bound = error_bound(c, 1 / world, BF16, reference=got["fp32"])
    err_accum = (got["accum"].double() - fp32).abs()
    err_bf16 = (got["bf16"].double() - fp32).abs()
    assert (err_accum <= bound).all(), (err_accum - bound).max()
    half = N  # the first half of the elements has bf16-exact contributions: no error at all
    assert torch.equal(err_accum[:half], torch.zeros(half, dtype=torch.float64))
    # today's bf16 reduce loses the small values under the large partial sums: where every contribution
    # is exact in bf16 its errors are up to 1/4 on results of order 1 (the fp32-accumulated one: none)
    assert (err_bf16[:half] > 0).sum() >= half // 3 and err_bf16[:half].max() >= 0.1, err_bf16[:half]
    assert err_bf16.max() > 2 * err_accum.max(), (err_bf16.max(), err_accum.max())
    # HSDP: every rank's piece rounded once, fp32 within each replica and across the replicas
    err_hsdp = (got["hsdp"].double() - fp32).abs()
    assert (err_hsdp <= bound).all() and torch.equal(err_hsdp[:half], torch.zeros(half, dtype=torch.float64))


# ----------------------------------------------------------------------------- training parity
STEPS, ACCUM, LR = 3, 2, 3e-3


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _train_sharded(rank, world):
    model = yafsdp.YaFSDP(Stack(), reduce_dtype=BF16, reduce_accum_dtype=torch.float32)
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUM):
            loss = loss_of(model, "stack", batch("stack", step, micro, rank))
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        t = torch.tensor(total)
        dist.all_reduce(t)
        losses.append(t.item() / world)
        norms.append(model.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return losses, norms, model.full_state_dict(), _bf16_backward(rank)


def _bf16_backward(rank):
    """A bf16 backward (tied Llama, 2 micro-batches): its grads are exact in bf16, so at world 2 the
    bf16 pieces summed in fp32 are the fp32 reduce's sums; both runs' weights, fp32 reduce first."""
    out = []
    for opts in (dict(), dict(reduce_dtype=BF16, reduce_accum_dtype=torch.float32)):
        model = yafsdp.YaFSDP(tiny_llama(tie=True), param_dtype=BF16, **opts)
        opt = _optimizer(model.parameters())
        for step in range(2):
            for micro in range(ACCUM):
                (loss_of(model, "llama", batch("llama", step, micro, rank)) / ACCUM).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        out.append(model.full_state_dict())
    return out


def _train_reference(world):
    """One process: each rank's (micro-batch) gradient rounded to bf16, summed in fp32 in rank order,
    divided by the world; clipping and AdamW as the sharded run."""
    model = Stack()
    opt = _optimizer(model.parameters())
    params = list(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        acc = [torch.zeros_like(p) for p in params]
        for micro in range(ACCUM):
            per_rank = []
            for r in range(world):
                loss = loss_of(model, "stack", batch("stack", step, micro, r))
                per_rank.append(torch.autograd.grad(loss / ACCUM, params))
                total += loss.item() / ACCUM / world
            for a, gs in zip(acc, zip(*per_rank)):
                s = gs[0].to(BF16).float()
                for g in gs[1:]:
                    s = s + g.to(BF16).float()
                a.add_(s * (1 / world))
        for p, a in zip(params, acc):
            p.grad = a
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_training_parity_with_bf16_rounded_contributions_summed_in_fp32():
    world = 2
    res = run_ranks(_train_sharded, world)
    ref_losses, ref_norms, ref_sd = _train_reference(world)
    losses, norms, sd, (bf16_fp32, bf16_accum) = res[0]  # the full state dicts are rank 0's
    assert set(sd) == set(ref_sd)
    assert rel_seq(losses, ref_losses) < 1e-5, (losses, ref_losses)
    assert rel_seq(norms, ref_norms) < 1e-5, (norms, ref_norms)
    assert rel_l2(sd, ref_sd) < 1e-4
    assert rel_l2(sd, dict(Stack().state_dict())) > 1e-3  # it trained
    # bf16 grads: the fp32-accumulated bf16 reduce is the fp32 reduce, bit for bit, at half the bytes
    assert set(bf16_fp32) == set(bf16_accum) and all(torch.equal(bf16_fp32[k], bf16_accum[k]) for k in bf16_fp32)
    assert rel_l2(bf16_accum, dict(tiny_llama(tie=True).state_dict())) > 1e-3


# ----------------------------------------------------------------------------- chunked outsized gradients
def _chunked_vs_own(rank, world):
    """A tied Llama with a 1000-word vocabulary (the embedding/head unit outsized), one step of 2
    micro-batches, AdamW: the final weights with the outsized gradient reduced in chunks
    through the grad pair (the default) and through a grad buffer of its own, under several
    process groups and reduce precisions. See [Note: chunked outsized gradients]."""
    shard, replicate = hsdp_groups(2, world // 2)
    setups = {
        "pair_fp32": dict(process_group=shard),  # a world of 2: a + b, whatever the chunking
        "flat_accum": dict(param_dtype=BF16, reduce_dtype=BF16, reduce_accum_dtype=torch.float32),  # rank order
        "hsdp_fp32": dict(process_group=(shard, replicate)),  # the replicas' all-reduce after the last chunk
        # grad_chunks=2: the decoder layers' gradients in 2 chunks through half-size grad buffers too
        "hsdp_gc2": dict(process_group=(shard, replicate), grad_chunks=2),
        "flat_accum_gc2": dict(param_dtype=BF16, reduce_dtype=BF16, reduce_accum_dtype=torch.float32, grad_chunks=2),
    }
    out = {}
    for name, opts in setups.items():
        for chunk in (True, False):  # False: nothing chunked
            kw = opts if chunk else {k: v for k, v in opts.items() if k != "grad_chunks"}
            model = yafsdp.YaFSDP(tiny_llama(tie=True, vocab=1000, layers=2), chunk_outsized_grads=chunk, **kw)
            chunks = [u.grad_chunk for u in model._rt.units]
            assert not chunk or model._rt.units[0].layout.shard_numel > 3 * chunks[0]  # several chunks
            opt = _optimizer(model.parameters())
            for micro in range(2):  # the second backward adds to the grad shards
                (loss_of(model, "llama", batch("llama", 0, micro, rank)) / 2).backward()
            opt.step()
            out[name, chunk] = (model.full_state_dict(), chunks, model.allocated_bytes())
    return out


def test_chunked_outsized_gradients_equal_the_own_buffer():
    res = _world4()[0]["chunked"]
    for name in ("pair_fp32", "flat_accum", "hsdp_fp32", "hsdp_gc2", "flat_accum_gc2"):
        (sd, chunks, alloc), (own_sd, own_chunks, own_alloc) = res[name, True], res[name, False]
        layers = [0] * (len(chunks) - 1) if "gc2" not in name else [chunks[0]] * (len(chunks) - 1)
        assert chunks[0] > 0 and chunks[1:] == layers and own_chunks == [0] * len(chunks), chunks
        assert "grad_outsized" not in alloc and own_alloc["grad_outsized"] > 0
        saved = own_alloc["grad_outsized"] + own_alloc["grad_outsized_staging"] + own_alloc.get("grad_outsized_accum", 0)
        if "gc2" in name:  # and half of each grad buffer of the pair (its staging, landing, accumulator)
            saved += sum(own_alloc[k] - alloc[k] for k in own_alloc if k.startswith(("grad0", "grad1")))
            assert all(alloc[k] <= own_alloc[k] // 2 + 256 for k in own_alloc if k.startswith(("grad0", "grad1")))
        assert sum(own_alloc.values()) - sum(alloc.values()) == saved
        assert rel_l2(sd, dict(tiny_llama(tie=True, vocab=1000, layers=2).state_dict())) > 1e-4  # it trained
        # the same sums in the same order (a world of 2: a + b; fp32 accumulation: rank order): bit for bit
        assert all(torch.equal(sd[k], own_sd[k]) for k in own_sd), name


def test_copy_columns_is_the_column_block_of_the_flat_unit():
    """``copy_columns`` (the chunked reduce's copy) against slicing the (world x shard) view, for
    parameters that start and end inside rows, span rows, and fill whole ones."""
    from yafsdp.engine.grad_path import copy_columns

    world, shard = 5, 13
    flat = torch.arange(world * shard, dtype=torch.float32) + 1
    cuts = [0, 3, 11, 12, 40, 41, 58, 60]  # the last two elements: padding (no parameter)
    for lo, hi in [(0, 13), (0, 4), (4, 9), (9, 13), (12, 13)]:
        dst = torch.zeros(world, hi - lo)
        for a, b in zip(cuts, cuts[1:]):
            copy_columns(dst, flat[a:b].clone(), a, shard, lo)
        want = flat.view(world, shard)[:, lo:hi].clone()
        pad = torch.arange(world * shard).view(world, shard)[:, lo:hi] >= cuts[-1]
        assert torch.equal(dst, torch.where(pad, torch.zeros(()), want)), (lo, hi)


def _direct_vs_chunks(rank, world):
    """An untied Llama (1000-word vocabulary: the embedding and the head are outsized one-parameter
    units), 2 steps of 2 micro-batches each (the first reduce of a step fresh, the second accumulating),
    AdamW: the direct exchange against the chunks and against an outsized grad buffer of its own."""
    out = {}
    for name in ("direct", "chunks", "own"):
        # the embedding gathered (not looked up from its shards): its reduce is one of the two under test
        model = yafsdp.YaFSDP(tiny_llama(vocab=1000, layers=2), chunk_outsized_grads=name != "own",
                              sharded_lookup=False)
        calls = []
        sched = model._rt.schedule
        real = sched.reduce_rows_into
        sched.reduce_rows_into = lambda *a, **k: (calls.append(a[-1]), real(*a, **k))
        if name == "chunks":
            model._rt.grad_path._exchanges_directly = lambda unit: False
        opt = _optimizer(model.parameters())
        for step in range(2):
            for micro in range(2):
                (loss_of(model, "llama", batch("llama", step, micro, rank)) / 2).backward()
            opt.step()
            opt.zero_grad()
        out[name] = (model.full_state_dict(), calls, [u.grad_chunk for u in model._rt.units])
    return out


def test_direct_exchange_of_outsized_gradients_equals_the_chunks():
    """[Note: the direct exchange of an outsized gradient]: at world 2 on gloo the first reduce of each
    step of the untied embedding and head goes straight from the autograd gradient into the grad shard;
    the trained weights are bit for bit those of the chunked reduce and of an own outsized grad buffer."""
    for r in run_ranks(_direct_vs_chunks, 2):
        (sd, calls, chunks), (sd_c, calls_c, _), (sd_o, calls_o, _) = r["direct"], r["chunks"], r["own"]
        assert sum(1 for c in chunks if c) == 2, chunks  # the embedding and the head are chunked units
        assert sorted(calls) == sorted(["model.embed_tokens", "lm_head"] * 2), calls  # fresh reduces only
        assert calls_c == [] and calls_o == []
        if sd:  # the full state dict is rank 0's
            assert rel_l2(sd, dict(tiny_llama(vocab=1000, layers=2).state_dict())) > 1e-4  # it trained
            assert all(torch.equal(sd[k], sd_c[k]) for k in sd) and all(torch.equal(sd[k], sd_o[k]) for k in sd)
