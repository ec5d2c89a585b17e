"""The multi-rank launcher: results, errors and hangs are reported, never hung on."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing.multirank import RankFailure, run_on_ranks


def _sum_of_ranks(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def test_returns_each_rank_value_in_rank_order():
    out = run_on_ranks(_sum_of_ranks, 3, args=(10,), timeout=60)
    assert out == [(0, 3, 33.0), (1, 3, 33.0), (2, 3, 33.0)]


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return "fine"


def test_exception_on_one_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_raise_on_rank_one, 2, timeout=60)
    msg = str(info.value)
    assert "--- rank 0: ok" in msg
    assert "--- rank 1: raised" in msg
    assert "ValueError: boom from rank one" in msg


def _hang_in_collective():
    if dist.get_rank() == 0:
        time.sleep(3600)  # never joins the all-reduce below
    t = torch.ones(1)
    dist.all_reduce(t)


def test_hung_collective_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_hang_in_collective, 2, timeout=12)
    elapsed = time.monotonic() - start
    assert elapsed < 40, f"launcher took {elapsed:.0f}s to give up"
    msg = str(info.value)
    assert "rank 0: killed (still running: hung?)" in msg
    assert "--- rank 1:" in msg


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_sum_of_ranks, 0)
    with pytest.raises(ValueError, match="backend"):
        run_on_ranks(_sum_of_ranks, 1, backend="mpi")
