"""The test harness's rank starter (tests/dist_utils.py): what the tests rely on it for."""
import os
import time

import torch
import torch.distributed as dist

from dist_utils import run_ranks


def _probe(rank, world):
    return os.environ.get("YAFSDP_TEST_PROBE"), os.environ["RANK"], torch.get_num_threads()


def test_ranks_see_the_callers_environment_at_each_call(monkeypatch):
    # The forkserver is started by the first call; its children must still see what is set later.
    monkeypatch.setenv("YAFSDP_TEST_PROBE", "first")
    assert run_ranks(_probe, 2) == [("first", "0", 1), ("first", "1", 1)]
    monkeypatch.setenv("YAFSDP_TEST_PROBE", "second")
    assert [r[0] for r in run_ranks(_probe, 2)] == ["second", "second"]
    monkeypatch.delenv("YAFSDP_TEST_PROBE")
    assert [r[0] for r in run_ranks(_probe, 1)] == [None]


def _late_subgroup(rank, world):
    # Rank 0 (the TCPStore's host) is done at once; ranks 1 and 2 build a group among themselves later,
    # through that store. Before the harness held rank 0 back this failed with "Failed to recv, got 0 bytes".
    if rank == 0:
        return None
    time.sleep(1.0)
    group = dist.new_group([1, 2], use_local_synchronization=True)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    return float(t)


def test_rank0_outlives_a_late_subgroup_rendezvous():
    assert run_ranks(_late_subgroup, 3) == [None, 3.0, 3.0]
