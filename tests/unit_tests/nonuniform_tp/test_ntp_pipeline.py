"""Nonuniform TP with pipeline parallelism: the failure map keyed by (replica, stage), the
layout (stage-major ranks, Megatron's own pipeline groups, a pair group per stage), and
training through Megatron's 1F1B schedule matching a uniform pipeline of the same stages."""

import argparse

import pytest
import torch

from megatron_ext.nonuniform_tp import NonuniformTPConfig, add_nonuniform_tp_args
from megatron_ext.nonuniform_tp.config import compute_uniform_tp_spares_with_parity, parse_failed_slots
from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks

from .ntp_bodies import train_cases
from .test_ntp_training import STEPS, WEIGHT_ATOL, _backends, _check_memory_reports

# ---- config and layout --------------------------------------------------------------------------
# replica 0 lost slot 0 of stage 1: it runs both stages at TP 1 (stage 0 leaves its slot 1 idle)
NTP_PP = dict(
    tp_base=2, tp_spares=1, non_active_ranks_per_dp={(0, 0): (1,), (0, 1): (0,)}, pipeline_model_parallel_size=2
)


def test_pipeline_failure_map_is_keyed_by_replica_and_stage():
    parser = add_nonuniform_tp_args(argparse.ArgumentParser())
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    args = parser.parse_args(
        ["--ntp-tp-base", "4", "--ntp-failed-slots", "1,1:2", "--pipeline-model-parallel-size", "3"]
    )
    cfg = NonuniformTPConfig.from_args(args)
    # spare parity over stages: every stage of replica 1 gives up one slot (the highest where none failed)
    assert cfg.non_active_ranks_per_dp == {(1, 0): (3,), (1, 1): (2,), (1, 2): (3,)}
    assert (cfg.tp_reduced, cfg.degraded_replicas, cfg.pipeline_model_parallel_size) == (3, [1], 3)
    assert parse_failed_slots("0,0:3", pipeline_model_parallel_size=1) == {0: (3,)}  # one stage: keyed by replica
    assert compute_uniform_tp_spares_with_parity({(0, 1): [0], (2, 0): [0, 1]}, 4, pipeline_model_parallel_size=2) == (
        2,
        {(0, 0): (2, 3), (0, 1): (0, 3), (2, 0): (0, 1), (2, 1): (2, 3)},
    )


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: parse_failed_slots("0:1", pipeline_model_parallel_size=2),
            r"--ntp-failed-slots: '0:1' names no pipeline stage; with --pipeline-model-parallel-size 2 write "
            r"REPLICA,STAGE:SLOTS \(e\.g\. '0,0:1'\)",
        ),
        (
            lambda: parse_failed_slots("0,2:1", pipeline_model_parallel_size=2),
            r"stage 2 in '0,2:1' is out of range; allowed: 0\.\.1 \(--pipeline-model-parallel-size 2\)",
        ),
        (lambda: parse_failed_slots("0,1,2:1"), r"cannot parse '0,1,2:1'; expected 'REPLICA\[,STAGE\]:SLOT"),
        (
            lambda: NonuniformTPConfig(**{**NTP_PP, "non_active_ranks_per_dp": {(0, 1): (0,)}}),
            r"lists replica 0 in stage\(s\) \[1\] but not in stage\(s\) \[0\]: a degraded replica runs every stage "
            r"at tp_reduced=1",
        ),
        (
            lambda: NonuniformTPConfig(**{**NTP_PP, "non_active_ranks_per_dp": {0: (0,)}}),
            r"key 0 names no pipeline stage; with pipeline_model_parallel_size=2 key the inactive slots by "
            r"\(replica, stage\)",
        ),
        (
            lambda: NonuniformTPConfig(**{**NTP_PP, "pipeline_model_parallel_size": 0}),
            r"pipeline_model_parallel_size \(--pipeline-model-parallel-size\) must be an int >= 1, got 0",
        ),
        (
            lambda: NonuniformTPConfig.from_args(
                argparse.Namespace(ntp_tp_base=2, ntp_failed_slots="0:1", num_layers_per_virtual_pipeline_stage=1)
            ),
            r"--num-layers-per-virtual-pipeline-stage 1 with --ntp-failed-slots: nonuniform TP does not run "
            r"interleaved pipeline schedules",
        ),
    ],
)
def test_pipeline_failure_maps_that_cannot_run_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_pipeline_layout_is_stage_major_with_a_pair_per_stage():
    lay = NonuniformTPConfig(**NTP_PP).layout(6)
    # stage 0: replica 0 (TP 1) rank 0, replica 1 ranks 1-2; stage 1 likewise from 3
    assert lay.pp == 2 and lay.all_tp_groups() == [[0], [1, 2], [3], [4, 5]]
    # rank i of every stage: what Megatron's initialize_model_parallel(TP=1, PP=2) builds on 6 ranks
    assert lay.all_pipeline_groups() == [[0, 3], [1, 4], [2, 5]]
    assert lay.all_dp_groups() == [[1], [2], [0], [4], [5], [3]]
    assert lay.all_pair_groups() == [[0, 1, 2], [3, 4, 5]]
    assert lay.all_model_parallel_groups() == [[0, 3], [1, 2, 4, 5]]
    assert lay.optimizer_groups() == [[1, 2, 4, 5], [0, 3]]
    assert lay.stage_optimizer_groups() == [[1, 2], [0], [4, 5], [3]]
    role = lay.role(3)
    assert (role.replica, role.stage, role.slot, role.tp_rank, role.kind) == (0, 1, 1, 0, "degraded")
    sim = NonuniformTPConfig(**{**NTP_PP, "launch_mode": "simulate"}).layout(8)
    assert sim.leaving == [1, 4] and sim.after_leaving().all_tp_groups() == lay.all_tp_groups()


# ---- training -----------------------------------------------------------------------------------
# Tied embeddings: the output layer of the last stage is the first stage's word embedding, its gradient
# summed over the embedding group (first and last stage of each pipeline) after the DP sync.
SPEC_PP = tiny_gpt.TinyGPTSpec(share_embeddings=True)
# Equal shares (2 micro-batches of 1 per replica), sequence parallelism on the healthy replica (TP 2).
EQUAL = dict(spec=SPEC_PP, global_batch=4, micro_batch_size=1, sequence_parallel=True)
# Shares by TP degree (1:2 of 6 micro-batches): the two replicas' pipelines run 2 and 4 micro-batches.
NTP_PP_TP_SHARES = dict(NTP_PP, balance="tp")
BALANCED = dict(spec=SPEC_PP, global_batch=6, micro_batch_size=1)
# Distributed optimizer, bucketed reduction overlapped with the backward, parameters gathered in the next forward.
OVERLAP = dict(EQUAL, distributed_optimizer=True, overlap=True, overlap_param_gather=True)
# The bar is test_ntp_training's (RTOL 1e-5 relative loss, WEIGHT_ATOL): the runs compute the same sums in
# other orders (TP partial sums, the replicas' weighted DP sum, the pair's added gradients), fp32 rounding carried
# through 10 Adam steps.
RTOL = 1e-5


def _loss(results, step):
    """The global batch's loss at ``step``: the mean of every micro-batch's token mean, from the last stage
    (one TP rank per replica; the replica's TP ranks report the same)."""
    means = {}
    for o in results:
        if o["last_stage"] and o["tp_rank"] == 0:
            means[o["replica"]] = [s / n for s, n in o["reports"][step]]
    rows = [m for d in sorted(means) for m in means[d]]
    return sum(rows) / len(rows)


def _check(results, ref, what):
    assert any(o["degraded"] for o in results) and any(not o["degraded"] for o in results)
    assert ref[0]["losses_learned"], f"{what}: the baseline did not learn"
    for step in range(STEPS):
        got, want = _loss(results, step), _loss(ref, step)
        assert abs(got - want) <= RTOL * abs(want), f"{what}, step {step}: NTP {got} vs uniform pipeline {want}"
        for o in results:  # reduce_loss_over_replicas: the same value on every rank, every stage
            assert abs(o["weighted"][step] - got) <= RTOL * abs(got), (what, step, o["weighted"][step], got)
    for stage in (0, 1):
        want = next(o for o in ref if o["stage"] == stage and o["final"] is not None)
        heads = [o for o in results if o["stage"] == stage and o["final"] is not None]
        assert sorted(o["replica"] for o in heads) == [0, 1]
        for name, tensor in want["final"].items():
            for o in heads:
                assert torch.equal(o["init"][name], want["init"][name]), (what, stage, name)
                err = (o["final"][name] - tensor).abs().max().item()
                assert err <= WEIGHT_ATOL, f"{what}, stage {stage}, replica {o['replica']}: {name} off by {err}"


def _learned(results):
    for o in results:
        losses = [_loss(results, k) for k in range(STEPS)]
        o["losses_learned"] = losses[-1] < losses[0] - 0.3
    return results


@pytest.mark.parametrize("backend", _backends(6))
def test_pipelined_ntp_trains_like_a_uniform_pipeline(backend):
    """TP 2 x PP 2, two replicas, replica 0 lost slot 0 of stage 1 (6 processes, packed): replica 0
    runs both stages at TP 1 as replica 1's satellite, stage by stage. 10 steps per case, in one job:
    equal shares with sequence parallelism; shares by TP degree (2 and 4 micro-batches: the two
    pipelines run different schedules); the distributed optimizer with overlapped gradient reduction
    and parameter gather. Each against a uniform TP 1 x PP 2 job (2 processes) of the same stages and
    global batch: the loss per step, and every stage's weights after training. Memory (plain optimizer):
    every rank holds its own stage's tensors only, a healthy one a uniform rank's parameters, gradients and
    Adam state, a degraded one no optimizer state, both at most one transfer unit of staging per dtype."""
    cases = [(NTP_PP, STEPS, EQUAL), (NTP_PP_TP_SHARES, STEPS, BALANCED), (NTP_PP, STEPS, OVERLAP)]
    base = [(None, STEPS, dict(kw, pp=2, sequence_parallel=False)) for _, _, kw in cases]
    per_rank = run_on_ranks(train_cases, 6, args=(cases,), timeout=400, backend=backend)
    ref_rank = run_on_ranks(train_cases, 2, args=(base,), timeout=300, backend=backend)
    for what, results, ref in zip(("equal shares + SP", "tp shares", "overlap"), zip(*per_rank), zip(*ref_rank)):
        _check(list(results), _learned(list(ref)), what)
    balanced = list(zip(*per_rank))[1]
    assert {o["replica"]: o["microbatches"] for o in balanced}[0] == [2, 4]
    equal = list(zip(*per_rank))[0]
    _check_memory_reports(equal)
    for o in equal:  # a stage's own layers: the first holds the embedding, the last the output layer (tied)
        names = set(o["compute_state"])
        assert any("layers.0." in n for n in names) and not any("layers.1." in n for n in names), names
        assert ("embedding.word_embeddings.weight" in names) is (o["stage"] == 0), names
        assert ("output_layer.weight" in names) is (o["stage"] == 1), names
