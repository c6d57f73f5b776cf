"""yafsdp.comm.collectives on gloo: the point-to-point all-gather and reduce-scatter against plain
references, several collectives in flight at once, waits from two threads, subgroups, bad sizes."""
import threading

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks


def _data(rank, world, n, salt):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(world * n, generator=g)


def _collectives(rank, world):
    from yafsdp.comm.collectives import P2PWork, all_gather, reduce_scatter

    group = dist.group.WORLD
    out = {}
    # Several of each in flight at once, of different sizes, waited in reverse issue order.
    sizes = [1, 7, 4096, 100_003]
    gathers, reduces = [], []
    for i, n in enumerate(sizes):
        shard = _data(rank, world, n, i)[:n].clone()
        full = torch.full((world * n,), float("nan"))
        gathers.append((full, all_gather(full, shard, group, async_op=True)))
        grads = _data(rank, world, n, 10 + i)
        s_out = torch.full((n,), float("nan"))
        reduces.append((s_out, reduce_scatter(s_out, grads, group, async_op=True)))
    for full, w in reversed(gathers):
        w.wait()
    for s_out, w in reversed(reduces):
        w.wait()
    out["gathered"] = [f for f, _ in gathers]
    out["reduced"] = [s for s, _ in reduces]
    out["kinds"] = sorted({type(w).__name__ for _, w in gathers + reduces})
    # Synchronous form.
    shard = torch.arange(3, dtype=torch.float32) + 10 * rank
    full = torch.empty(3 * world)
    assert all_gather(full, shard, group, async_op=False) is None
    out["sync_gather"] = full
    full_default = torch.empty(3 * world)
    all_gather(full_default, shard, None, async_op=False)  # group=None: the default group
    out["default_group_gather"] = full_default
    s_out = torch.empty(2)
    assert reduce_scatter(s_out, torch.arange(2 * world, dtype=torch.float32) * (rank + 1), group, async_op=False) is None
    out["sync_reduce"] = s_out
    # Two threads waiting on one handle (the trace recorder watches handles from a thread): both
    # return, and the reduce's local add runs exactly once.
    n = 50_000
    grads = _data(rank, world, n, 99)
    s_out = torch.empty(n)
    w = reduce_scatter(s_out, grads, group, async_op=True)
    t = threading.Thread(target=w.wait)
    t.start()
    w.wait()
    t.join(timeout=60)
    out["two_waiters_alive"] = t.is_alive()
    out["two_waiters"] = s_out
    out["completed"] = w.is_completed()
    out["p2p_handle"] = isinstance(w, P2PWork)
    # Wrong sizes are refused with the sizes named.
    errors = []
    try:
        all_gather(torch.empty(world * 4 + 1), torch.empty(4), group)
    except ValueError as e:
        errors.append(str(e))
    if world == 2:
        try:
            reduce_scatter(torch.empty(3), torch.empty(8), group)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_collectives_match_reference(world):
    res = run_ranks(_collectives, world)
    sizes = [1, 7, 4096, 100_003]
    for rank, out in enumerate(res):
        for i, n in enumerate(sizes):
            want = torch.cat([_data(r, world, n, i)[:n] for r in range(world)])
            assert torch.equal(out["gathered"][i], want), (rank, n)
            total = sum(_data(r, world, n, 10 + i) for r in range(world))
            torch.testing.assert_close(out["reduced"][i], total.chunk(world)[rank], rtol=1e-6, atol=1e-6)
        assert torch.equal(out["sync_gather"], torch.cat([torch.arange(3.0) + 10 * r for r in range(world)]))
        assert torch.equal(out["default_group_gather"], out["sync_gather"])
        want = (torch.arange(2 * world, dtype=torch.float32) * sum(r + 1 for r in range(world))).chunk(world)[rank]
        torch.testing.assert_close(out["sync_reduce"], want)
        assert not out["two_waiters_alive"]
        total = sum(_data(r, world, 50_000, 99) for r in range(world))
        torch.testing.assert_close(out["two_waiters"], total.chunk(world)[rank], rtol=1e-6, atol=1e-6)
        # Gathers are point-to-point at every world size; reduces at world 2 only.
        assert out["p2p_handle"] == (world == 2)
        if world == 2:
            assert out["completed"]
        assert "P2PWork" in out["kinds"]
        assert any("output has" in e and f"world ({world})" in e for e in out["errors"])
        if world == 2:
            assert any("shard_out has 3 elements, expected 4" in e for e in out["errors"])


def _subgroup(rank, world):
    from yafsdp.comm.collectives import all_gather, reduce_scatter

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    shard = torch.full((5,), float(rank))
    full = torch.empty(10)
    all_gather(full, shard, group, async_op=True).wait()
    s_out = torch.empty(4)
    reduce_scatter(s_out, torch.arange(8, dtype=torch.float32) + rank, group, async_op=True).wait()
    return full, s_out


def test_p2p_collectives_in_a_subgroup():
    """Group ranks are mapped to global ranks: ranks {1, 3} form group ranks {0, 1}."""
    res = run_ranks(_subgroup, 4)
    for rank, (full, s_out) in enumerate(res):
        members = [rank % 2, rank % 2 + 2]
        assert torch.equal(full, torch.cat([torch.full((5,), float(m)) for m in members]))
        total = sum(torch.arange(8, dtype=torch.float32) + m for m in members)
        assert torch.equal(s_out, total.chunk(2)[members.index(rank)])


def _world_one(rank, world):
    from yafsdp.comm.collectives import P2PWork, all_gather, reduce_scatter

    shard = torch.randn(7, generator=torch.Generator().manual_seed(3))
    full = torch.full((7,), float("nan"))
    gw = all_gather(full, shard, None, async_op=True, local=True)
    grads = torch.randn(7, generator=torch.Generator().manual_seed(4))
    s_out = torch.full((7,), float("nan"))
    rw = reduce_scatter(s_out, grads, None, async_op=True, local=True)
    done = [isinstance(w, P2PWork) and w.is_completed() for w in (gw, rw)]  # local copies: complete at once
    gw.wait(), rw.wait()
    errors = []
    for call in (lambda: all_gather(torch.empty(8), shard, None, local=True),
                 lambda: reduce_scatter(torch.empty(6), grads, None, local=True),
                 lambda: all_gather(torch.empty(7, dtype=torch.bfloat16), shard, None, local=True)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return done, torch.equal(full, shard), torch.equal(s_out, grads), errors


def test_world_one_is_a_local_copy():
    """At world 1 on gloo, asked for by the host schedule (local=True), the all-gather and the
    reduce-scatter are local copies (no gloo worker call), bit-identical to the input, with complete
    handles; wrong sizes are still refused."""
    [(done, gathered, reduced, errors)] = run_ranks(_world_one, 1)
    assert done == [True, True] and gathered and reduced
    assert len(errors) == 3 and "8 elements" in errors[0] and "6 elements" in errors[1], errors
    assert "torch.bfloat16, expected the shard's 7 of torch.float32" in errors[2], errors
