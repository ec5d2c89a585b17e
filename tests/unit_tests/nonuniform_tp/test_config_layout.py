"""Pure (single-process) tests: config validation, flags, spare parity, rank
layout and the reshard plan."""

import argparse
import dataclasses
import logging

import pytest
import torch

from megatron_ext.nonuniform_tp import (
    NonuniformTPConfig,
    add_nonuniform_tp_args,
    compute_uniform_tp_spares_with_parity,
    format_failed_slots,
    parse_failed_slots,
)
from megatron_ext.nonuniform_tp import reshard


def test_spare_parity_takes_the_worst_replica_and_pads_the_others():
    spares, slots = compute_uniform_tp_spares_with_parity({0: [3], 2: [1, 5], 4: []}, tp_base=8)
    assert spares == 2
    # replica 0 lost slot 3 and also gives up its highest healthy slot, 7
    assert slots == {0: (3, 7), 2: (1, 5)}
    assert compute_uniform_tp_spares_with_parity({}, 4) == (0, {})
    # 32 heads: a replica that lost one GPU of 8 runs at TP 4 (7, 6 and 5 do not split 32 heads)
    assert compute_uniform_tp_spares_with_parity({1: [2]}, 8, divides={"num_attention_heads": 32}) == (
        4,
        {1: (2, 5, 6, 7)},
    )
    # 12 heads, tp_base 4: 3 splits them; ffn 192 too
    assert compute_uniform_tp_spares_with_parity(
        {0: [0]}, 4, divides={"num_attention_heads": 12, "ffn_hidden_size": 192, "num_query_groups": None}
    ) == (1, {0: (0,)})
    with pytest.raises(ValueError, match="at least one GPU"):
        compute_uniform_tp_spares_with_parity({0: [0, 1]}, 2)
    with pytest.raises(ValueError, match=r"allowed: 0\.\.1"):
        compute_uniform_tp_spares_with_parity({0: [2]}, 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp_base=0), "tp_base must be an int >= 1"),
        (dict(tp_base=2, tp_spares=2, non_active_ranks_per_dp={0: (0, 1)}), r"tp_spares must be in 0\.\.1"),
        (dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (2,)}), r"slot 2 is out of range; allowed: 0\.\.1"),
        (dict(tp_base=4, tp_spares=2, non_active_ranks_per_dp={0: (1, 1)}), "duplicated slot"),
        (dict(tp_base=4, tp_spares=2, non_active_ranks_per_dp={0: (1,)}), "must deactivate exactly"),
        (
            dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={2: (0,)}, data_parallel_size=2),
            r"replica index 2 is out of range; allowed: 0\.\.1",
        ),
        (dict(tp_base=2, tp_spares=1), "non_active_ranks_per_dp is empty"),
        (dict(tp_base=2, launch_mode="mpi"), "launch_mode must be one of"),
        (
            dict(tp_base=4, tp_spares=1, non_active_ranks_per_dp={0: (0,)}, num_attention_heads=8),
            r"num_attention_heads=8 cannot be split over TP degree\(s\) \[3\]",
        ),
        (
            dict(
                tp_base=4, tp_spares=2, non_active_ranks_per_dp={0: (0, 1)}, num_query_groups=2, num_attention_heads=8
            ),
            r"num_query_groups=2 cannot be split over TP degree\(s\) \[4\]",
        ),
        (
            dict(tp_base=4, tp_spares=1, non_active_ranks_per_dp={0: (0,)}, ffn_hidden_size=128),
            r"ffn_hidden_size=128 cannot be split",
        ),
        (
            dict(tp_base=4, tp_spares=1, non_active_ranks_per_dp={0: (0,)}, vocab_size=128),
            r"vocab_size=128 cannot be split",
        ),
    ],
)
def test_bad_configs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NonuniformTPConfig(**kwargs)


def test_layout_must_match_world_size():
    cfg = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    assert cfg.layout(3).num_replicas == 2
    with pytest.raises(ValueError, match="launch exactly the healthy GPUs"):
        cfg.layout(4)
    with pytest.raises(ValueError, match="does not match world size 5"):
        NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)}, data_parallel_size=2).layout(5)
    with pytest.raises(ValueError, match=r"names replica\(s\) \[3\] but the job has 3 replicas"):
        NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={3: (1,)}).layout(5)
    sim = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)}, launch_mode="simulate")
    with pytest.raises(ValueError, match="multiple of tp_base=2"):
        sim.layout(3)


def test_packed_and_simulated_layouts():
    cfg = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (0,)})
    lay = cfg.layout(3)
    # replica 0 lost slot 0: its survivor (slot 1) is global rank 0 and TP rank 0
    assert lay.all_tp_groups() == [[0], [1, 2]]
    # the healthy replica's DP groups (one per TP rank), then the degraded rank alone
    assert lay.all_dp_groups() == [[1], [2], [0]]
    assert lay.role(0).degraded and lay.role(0).slot == 1 and lay.role(0).tp_rank == 0
    assert [lay.role(r).kind for r in range(3)] == ["degraded", "partner", "partner"]
    assert lay.partners == {0: 1} and lay.all_pair_groups() == [[0, 1, 2]]
    assert lay.optimizer_groups() == [[1, 2], [0]]

    sim = NonuniformTPConfig(
        tp_base=4, tp_spares=2, non_active_ranks_per_dp={1: (0, 3)}, launch_mode="simulate"
    ).layout(12)
    assert sim.all_tp_groups() == [[0, 1, 2, 3], [5, 6], [8, 9, 10, 11]]
    assert sim.all_dp_groups() == [[0, 8], [1, 9], [2, 10], [3, 11], [5], [6]]
    assert sim.role(4) is None and sim.role(7) is None
    assert sim.active_ranks == [0, 1, 2, 3, 5, 6, 8, 9, 10, 11]
    # replica 1 is replica 0's satellite; replica 2 is a bystander
    assert sim.partners == {1: 0} and sim.all_pair_groups() == [[0, 1, 2, 3, 5, 6]]
    assert [sim.role(r).kind for r in (0, 5, 8)] == ["partner", "degraded", "bystander"]

    # two degraded replicas get distinct partners, in index order
    two = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,), 2: (0,)}).layout(6)
    assert two.partners == {0: 1, 2: 3}
    # every replica degraded: a uniform job at tp_reduced (no partners, DP over all replicas)
    every = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,), 1: (1,)}).layout(2)
    assert not every.nonuniform and every.all_dp_groups() == [[0, 1]] and every.role(0).kind == "uniform"
    assert every.all_pair_groups() == [] and every.optimizer_groups() == [[0, 1]]


def test_drop_policy_leaves_the_degraded_replicas_out():
    cfg = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={1: (0,)}, policy="drop")
    launched = cfg.layout(5)  # packed: replica 0 ranks 0-1, replica 1 (degraded) rank 2, replica 2 ranks 3-4
    assert launched.leaving == [2] and launched.role(2) is None and launched.active_ranks == [0, 1, 3, 4]
    after = launched.after_leaving()
    assert after.num_replicas == 2 and after.all_tp_groups() == [[0, 1], [2, 3]] and not after.nonuniform
    assert after.all_dp_groups() == [[0, 2], [1, 3]] and {after.role(r).kind for r in range(4)} == {"uniform"}
    assert cfg.kept_replicas(3) == 2 and cfg.replica_tp_degrees(2) == [2, 2]
    # the shares are the healthy replicas' alone (equal: they run alike)
    assert cfg.batch_shares(8, 1, num_replicas=2).microbatches == (4, 4)
    # simulate mode: the failed slot and the dropped replica's other slot leave
    sim = dataclasses.replace(cfg, launch_mode="simulate").layout(6)
    assert sim.leaving == [2, 3] and sim.after_leaving().all_tp_groups() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="--ntp-policy drop: every one of the 2 replicas lost GPUs"):
        NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (0,), 1: (0,)}, policy="drop").layout(2)
    with pytest.raises(ValueError, match=r"policy \(--ntp-policy\) must be one of \('auto', 'degrade', 'drop'\)"):
        NonuniformTPConfig(tp_base=2, policy="never")


def test_auto_policy_predicts_both_and_takes_the_faster(caplog):
    """--ntp-policy auto with Megatron's batch flags: one INFO line with both predictions. With equal
    shares the degraded replica (TP 1 of 2) is the straggler: 2 micro-batches each take it as long as 4
    on a healthy replica, and the pair's transfers come on top, so dropping it (the healthy replica
    takes all 4) is faster. With balanced shares (1:3) the degraded replica adds throughput: degrade."""
    parser = add_nonuniform_tp_args(argparse.ArgumentParser())
    flags = ["--ntp-tp-base", "2", "--ntp-failed-slots", "0:1"]
    args = parser.parse_args(flags)
    args.global_batch_size, args.micro_batch_size, args.world_size = 4, 1, 3
    with caplog.at_level(logging.INFO, logger="megatron_ext.nonuniform_tp.policy"):
        assert NonuniformTPConfig.from_args(args).policy == "drop"
    (line,) = [r.getMessage() for r in caplog.records if "--ntp-policy auto" in r.getMessage()]
    assert "degrade to TP 1 (ntp unbalanced)" in line and line.endswith(": drop"), line
    args = parser.parse_args(flags + ["--ntp-balance", "tp"])
    args.global_batch_size, args.micro_batch_size, args.world_size = 64, 1, 3
    assert NonuniformTPConfig.from_args(args).policy == "degrade"
    args = parser.parse_args(flags + ["--ntp-policy", "degrade"])  # told: no prediction
    args.global_batch_size, args.micro_batch_size, args.world_size = 4, 1, 3
    assert NonuniformTPConfig.from_args(args).policy == "degrade"
    # built in code without the global batch: degrade
    assert NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)}).policy == "auto"
    assert not NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)}).drops


def test_more_degraded_than_healthy_replicas_is_refused_naming_the_flag():
    cfg = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,), 1: (0,)})
    with pytest.raises(ValueError, match=r"--ntp-failed-slots lists 2 degraded replica\(s\) but the job has only 1"):
        cfg.layout(4)  # 3 replicas, 2 of them degraded


def test_flags_pick_the_largest_degree_the_model_splits_at():
    """Megatron's --num-attention-heads 32 with --ntp-tp-base 8 and one lost GPU: TP 7 does not split
    32 heads, so the degraded replica runs at 4 (was refused, and the user had to find --ntp-spares 4)."""
    parser = add_nonuniform_tp_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ntp-tp-base", "8", "--ntp-failed-slots", "1:2"])
    args.num_attention_heads, args.ffn_hidden_size = 32, 14336
    args.group_query_attention, args.num_query_groups = True, 8
    cfg = NonuniformTPConfig.from_args(args)
    assert (cfg.tp_reduced, cfg.non_active_ranks_per_dp) == (4, {1: (2, 5, 6, 7)})
    args.num_attention_heads = 56  # 7 splits 56 heads, 8 query groups do not: 4 again
    assert NonuniformTPConfig.from_args(args).tp_reduced == 4
    args.num_query_groups, args.ffn_hidden_size = 7, 7 * 2048
    assert NonuniformTPConfig.from_args(args).tp_reduced == 7


def test_sequence_parallel_needs_the_sequence_to_split_at_both_degrees():
    """With Megatron's --sequence-parallel each TP rank holds its part of the sequence, at tp_base on a healthy
    replica and at tp_reduced on a degraded one: --seq-length must split at both (refused naming both flags and
    the multiples that do); without --ntp-spares the reduced degree is the largest that splits it."""
    parser = add_nonuniform_tp_args(argparse.ArgumentParser())
    parser.add_argument("--sequence-parallel", action="store_true")  # Megatron-LM's flags
    parser.add_argument("--seq-length", type=int)
    flags = ["--ntp-tp-base", "4", "--ntp-failed-slots", "0:1", "--ntp-policy", "degrade", "--seq-length", "16"]
    cfg = NonuniformTPConfig.from_args(parser.parse_args([*flags, "--sequence-parallel"]))
    assert (cfg.tp_reduced, cfg.sequence_parallel, cfg.seq_length) == (2, True, 16)  # 3 does not split 16
    assert NonuniformTPConfig.from_args(parser.parse_args(flags)).tp_reduced == 3  # no SP: the sequence is whole
    assert NonuniformTPConfig.from_args(parser.parse_args([*flags, "--seq-length", "24", "--sequence-parallel"])) == (
        NonuniformTPConfig(4, 1, {0: (1,)}, policy="degrade", sequence_parallel=True, seq_length=24)
    )
    needles = (
        r"NonuniformTPConfig\.seq_length=16 \(--seq-length\) cannot be split over TP degree\(s\) \[3\] with "
        r"sequence_parallel \(--sequence-parallel.*divisible by tp_base=4 and tp_reduced=3, i\.e\. a multiple of "
        r"12 \(e\.g\. 24\); or pick tp_spares \(--ntp-spares\)"
    )
    with pytest.raises(ValueError, match=needles):
        NonuniformTPConfig.from_args(parser.parse_args([*flags, "--sequence-parallel", "--ntp-spares", "1"]))
    with pytest.raises(ValueError, match=r"seq_length=18 .* TP degree\(s\) \[4\]"):
        NonuniformTPConfig(4, 2, {0: (0, 1)}, sequence_parallel=True, seq_length=18)
    NonuniformTPConfig(4, 2, {0: (0, 1)}, seq_length=18)  # no sequence parallelism: not checked
    with pytest.raises(ValueError, match=r"seq_length \(--seq-length\) must be an int >= 1 or None, got 0"):
        NonuniformTPConfig(2, sequence_parallel=True, seq_length=0)
    with pytest.raises(ValueError, match=r"sequence_parallel must be True or False, got 'yes'"):
        NonuniformTPConfig(2, sequence_parallel="yes")


def test_flags_round_trip():
    parser = add_nonuniform_tp_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ntp-tp-base", "8", "--ntp-failed-slots", "0:3;2:1,5"])
    cfg = NonuniformTPConfig.from_args(args)
    assert (cfg.tp_base, cfg.tp_spares, cfg.tp_reduced) == (8, 2, 6)
    assert cfg.non_active_ranks_per_dp == {0: (3, 7), 2: (1, 5)}
    assert parse_failed_slots(format_failed_slots(cfg.non_active_ranks_per_dp)) == cfg.non_active_ranks_per_dp
    assert NonuniformTPConfig.from_args(parser.parse_args([])) is None
    with pytest.raises(ValueError, match=r"REPLICA\[,STAGE\]:SLOT"):
        parse_failed_slots("0-3")
    explicit = NonuniformTPConfig.from_args(
        parser.parse_args(
            ["--ntp-tp-base", "4", "--ntp-spares", "1", "--ntp-failed-slots", "1:2", "--ntp-launch-mode", "simulate"]
        )
    )
    assert explicit.non_active_ranks_per_dp == {1: (2,)} and explicit.launch_mode == "simulate"


@pytest.mark.parametrize("b,r,chunks,dim", [(2, 1, 1, 0), (4, 3, 1, 1), (4, 2, 2, 0), (4, 3, 2, 0)])
def test_reshard_plan_moves_base_shards_into_reduced_shards(b, r, chunks, dim):
    n = 24 * chunks  # global size along dim, divisible by b and r
    full = torch.randn(n, 5) if dim == 0 else torch.randn(5, n)
    per_chunk = [c for c in full.chunk(chunks, dim)]

    def shard(t):  # Megatron's layout at degree t: per rank, the rank's slice of every chunk
        return [torch.cat([c.chunk(t, dim)[k] for c in per_chunk], dim) for k in range(t)]

    base, want = shard(b), shard(r)
    spec = reshard.ShardSpec(dim, chunks)
    pieces = reshard.reshard_pieces(0, spec, base[0].shape[dim], b, r)
    got = [torch.full_like(w, float("nan")) for w in want]
    for p in pieces:
        p.view(got[p.dst], "dst").copy_(p.view(base[p.src], "src"))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # a partner (group ranks 0..b-1) and its satellite (b..b+r-1): gradients go the other way, added
    grads = reshard.pair_pieces(0, spec, base[0].shape[dim], range(b), range(b, b + r), gradient=True)
    back = [torch.zeros_like(x) for x in base]
    for p in grads:
        assert p.add and p.src >= b > p.dst
        p.view(back[p.dst], "dst").add_(p.view(want[p.src - b], "src"))
    for g, w in zip(back, base):
        assert torch.equal(g, w)


def test_replicated_tensors_between_a_partner_and_its_satellite():
    base, sat = [0, 1, 2, 3], [4, 5, 6]  # tp_base=4 partner, tp_reduced=3 satellite (group ranks)
    params = reshard.pair_pieces(7, reshard.ShardSpec(None), 0, base, sat, gradient=False)
    assert [(p.src, p.dst, p.add) for p in params] == [(0, 4, False), (1, 5, False), (2, 6, False)]
    # every partner rank adds one satellite rank's (whole) gradient: j takes j % tp_reduced's
    grads = reshard.pair_pieces(7, reshard.ShardSpec(None), 0, base, sat, gradient=True)
    assert [(p.src, p.dst, p.add) for p in grads] == [(4, 0, True), (5, 1, True), (6, 2, True), (4, 3, True)]
    # a partial sum per TP rank (qk_layernorm gradients): satellite rank i's part into partner rank i only,
    # so that the partner's TP sum holds every part once
    summed = reshard.pair_pieces(7, reshard.ShardSpec(None), 0, base, sat, gradient=True, summed=True)
    assert [(p.src, p.dst, p.add) for p in summed] == [(4, 0, True), (5, 1, True), (6, 2, True)]


def test_tp_summed_grads_follow_finalize_model_grads_and_tp_averaged_ones_are_refused():
    """The parameters whose gradient finalize_model_grads sums over TP (a degraded replica's
    partial sums join its partner's once); those it averages over TP are refused, and so is fp16."""
    from types import SimpleNamespace

    qk, plain = SimpleNamespace(qk_layernorm=True), SimpleNamespace(qk_layernorm=False)
    norm = torch.nn.Parameter(torch.ones(4))
    assert reshard.tp_summed_grad(qk, "decoder.layers.0.self_attention.k_layernorm.weight", norm)
    assert not reshard.tp_summed_grad(plain, "decoder.layers.0.self_attention.k_layernorm.weight", norm)
    assert not reshard.tp_summed_grad(qk, "decoder.layers.0.input_layernorm.weight", norm)
    sp = torch.nn.Parameter(torch.ones(4))
    sp.sequence_parallel = True
    assert reshard.tp_summed_grad(SimpleNamespace(sequence_parallel=True), "decoder.final_layernorm.weight", sp)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight.average_gradients_across_tp_domain = True
    tc = SimpleNamespace(num_attention_heads=4, num_query_groups=None, ffn_hidden_size=8)
    ntp = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    with pytest.raises(ValueError, match=r"average_gradients_across_tp_domain=True\): \['1\.weight'\].*Freeze them"):
        ntp.check_model(tc, module=model)
    ntp.check_model(tc)  # the config alone is fine
    NonuniformTPConfig(tp_base=2).check_model(tc, module=model)  # no failure: a uniform job
    model[1].weight.requires_grad_(False)
    ntp.check_model(tc, module=model)
    with pytest.raises(ValueError, match=r"nonuniform TP does not train MoE models \(num_moe_experts=4\)"):
        ntp.check_model(SimpleNamespace(**vars(tc), num_moe_experts=4))
    with pytest.raises(ValueError, match=r"does not train with fp16 \(TransformerConfig.fp16=True, --fp16\).*use bf16"):
        ntp.check_model(SimpleNamespace(**vars(tc), fp16=True))


FORM = "'REPLICA[,STAGE]:SLOT[,SLOT...]' entries separated by ';'"


@pytest.mark.parametrize(
    "text,kwargs,needles",
    [
        ("0:", {}, ["--ntp-failed-slots: replica 0 lists no slot in '0:'", FORM]),
        ("0:1,1", {}, ["--ntp-failed-slots: slot 1 listed twice for replica 0", "list each failed TP slot once"]),
        ("0:1;;", {}, ["--ntp-failed-slots: empty entry in '0:1;;'", "REPLICA[,STAGE]:SLOT"]),
        (";0:1", {}, ["--ntp-failed-slots: empty entry in ';0:1'"]),
        ("1:2,2", dict(tp_base=4), ["--ntp-failed-slots: slot 2 listed twice for replica 1"]),
        ("-1:1", {}, ["--ntp-failed-slots: replica index -1 in '-1:1' is out of range; allowed: REPLICA >= 0"]),
        ("0:-2", {}, ["--ntp-failed-slots: slot -2 of replica 0 is out of range; allowed: SLOT >= 0"]),
        (
            "0:4",
            dict(tp_base=4),
            ["--ntp-failed-slots: slot 4 of replica 0 is out of range; allowed: 0..3 (--ntp-tp-base 4)"],
        ),
        (
            "2:0",
            dict(data_parallel_size=2),
            [
                "--ntp-failed-slots: replica index 2 in '2:0' is out of range; allowed: 0..1 "
                "(--ntp-data-parallel-size 2)"
            ],
        ),
    ],
)
def test_parse_failed_slots_refuses_naming_the_flag_and_the_form(text, kwargs, needles):
    with pytest.raises(ValueError) as err:
        parse_failed_slots(text, **kwargs)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "argv,needles",
    [
        # accepted and silently deduplicated before
        (
            ["--ntp-tp-base", "4", "--ntp-failed-slots", "1:2,2"],
            ["argument --ntp-failed-slots: slot 2 listed twice for replica 1"],
        ),
        (
            ["--ntp-tp-base", "4", "--ntp-failed-slots", "0:"],
            ["argument --ntp-failed-slots: replica 0 lists no slot", FORM],
        ),
        # argparse reads '-1:1' as an option: the user gets the flag and the allowed form, not 'expected one argument'
        (
            ["--ntp-tp-base", "4", "--ntp-failed-slots", "-1:1"],
            ["argument --ntp-failed-slots: expected a value", FORM, "replica indices and slots are >= 0"],
        ),
        (
            ["--ntp-tp-base", "4", "--ntp-failed-slots=-1:1"],
            ["argument --ntp-failed-slots: replica index -1 in '-1:1' is out of range; allowed: REPLICA >= 0"],
        ),
        (["--ntp-tp-base", "4", "--ntp-failed-slots"], ["argument --ntp-failed-slots: expected a value", FORM]),
    ],
)
def test_failed_slots_flag_refused_at_parse_time(argv, needles, capsys):
    parser = add_nonuniform_tp_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    "argv,needles",
    [
        (
            ["--ntp-tp-base", "4", "--ntp-failed-slots", "0:4"],
            ["--ntp-failed-slots: slot 4 of replica 0 is out of range; allowed: 0..3 (--ntp-tp-base 4)"],
        ),
        (
            ["--ntp-tp-base", "4", "--ntp-spares", "1", "--ntp-failed-slots", "0:9"],
            ["--ntp-failed-slots: slot 9 of replica 0 is out of range; allowed: 0..3"],
        ),
        (
            ["--ntp-tp-base", "2", "--ntp-data-parallel-size", "2", "--ntp-failed-slots", "3:0"],
            [
                "--ntp-failed-slots: replica index 3 in '3:0' is out of range; allowed: 0..1 "
                "(--ntp-data-parallel-size 2)"
            ],
        ),
        # silently turned NTP off before
        (
            ["--ntp-failed-slots", "0:1"],
            [
                "--ntp-failed-slots '0:1' given without --ntp-tp-base",
                "--ntp-spares",
                "need --ntp-tp-base N (an int >= 1",
            ],
        ),
        (
            ["--ntp-spares", "1"],
            ["--ntp-spares 1 given without --ntp-tp-base", "--ntp-failed-slots", "need --ntp-tp-base N (an int >= 1"],
        ),
    ],
)
def test_failed_slots_and_spares_refused_by_from_args_naming_the_flags(argv, needles):
    parser = add_nonuniform_tp_args(argparse.ArgumentParser())
    with pytest.raises(ValueError) as err:
        NonuniformTPConfig.from_args(parser.parse_args(argv))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_format_failed_slots_leaves_healthy_replicas_out():
    assert format_failed_slots({0: (), 1: (0, 2)}) == "1:0,2"
    assert parse_failed_slots(format_failed_slots({0: (), 1: (0, 2)})) == {1: (0, 2)}
