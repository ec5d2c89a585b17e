"""Layouts and reshard plans, on CPU without processes: every destination
element is planned exactly once from a rank that holds it, replicated sources
share the work, and applying the plan's runs to the trainer's local tensors
gives exactly the engine's local tensors built independently from the HF
weights (Megatron's own QKV / fc1 shards are written out by hand in ``_reference``)."""

import json
import math
import types

import pytest
import torch
from torch import nn

from megatron_ext.sharding import Box, gpt_specs, megatron_layout, whole_layout
from megatron_ext.weight_export.plan.layout import inference_layout
from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan, check_reshard_plan, run_view

from ._reference import megatron_shard

DENSE = dict(
    num_layers=2,
    hidden_size=16,
    num_heads=4,
    num_groups=2,
    head_dim=4,
    ffn_hidden_size=24,
    vocab_size=30,
    padded_vocab_size=32,
    qkv_bias=True,
    qk_norm=True,
    dtype=torch.float32,
)
MOE = dict(DENSE, num_experts=4, moe_ffn_hidden_size=8)


def _hf_weights(specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for s in specs}


def _engine_locals(layout, weights):
    """Each engine rank's local tensors, stacked from the HF weights by the layout's segments."""
    out = {}
    for r, locals_ in layout.tensors.items():
        out[r] = {
            n: torch.cat([weights[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments])
            for n, lt in locals_.items()
        }
    return out


def _mcore_expert_coords(*, tp, dp, ep, etp, pp=1):
    """``{rank: (ep_rank, etp_rank)}`` from megatron-core's own expert RankGenerator,
    built with the arguments ``parallel_state.initialize_model_parallel`` gives it
    (``tp=expert_tensor_parallel_size``, ``dp=world / (etp * ep * pp)``, ``cp=1``,
    order ``tp-cp-ep-dp-pp`` with the gtp_remat axis injected after ``ep``)."""
    from megatron.core import parallel_state as ps

    gen = ps.RankGenerator(
        tp=etp,
        ep=ep,
        dp=tp * dp // (ep * etp),
        pp=pp,
        cp=1,
        order=ps._inject_gtp_remat_axis("tp-cp-ep-dp-pp", after="ep"),
    )
    ep_rank = {r: k for group in gen.get_ranks("ep") for k, r in enumerate(group)}
    etp_rank = {r: k for group in gen.get_ranks("tp") for k, r in enumerate(group)}
    return {r: (ep_rank[r], etp_rank[r]) for r in range(tp * dp * pp)}


def _megatron_locals(layout, weights, specs, tp, *, coords=None, ep=1, etp=1):
    """Each trainer rank's local tensors as Megatron lays them out, built by hand
    (``_reference.megatron_shard``), not with the layout.
    Experts: the whole HF expert sharded by hand over expert TP, on the
    ``(ep_rank, etp_rank)`` that ``coords`` (megatron-core's) gives each rank."""
    out = {}
    num_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=0)
    for i, (r, locals_) in enumerate(layout.tensors.items()):
        tp_rank = i % tp
        out[r] = {}
        for name, lt in locals_.items():
            members = sorted(
                {seg.name: layout.specs[seg.name] for seg in lt.segments}.values(),
                key=lambda s: s.fused[1] if s.fused else 0,
            )
            first = members[0]
            if first.expert is not None:  # experts: fc1 [gate_r; up_r] (rows), fc2 columns of the ETP rank
                ep_rank, etp_rank = coords[i] if coords else (None, 0)
                if coords:
                    assert first.expert // (num_experts // ep) == ep_rank, (r, name)
                dim = 1 if "down_proj" in first.name else 0
                out[r][name] = torch.cat([weights[m.name].chunk(etp, dim)[etp_rank] for m in members])
                continue
            shard = megatron_shard(
                first.fused[0] if first.fused else "copy",
                [weights[m.name] for m in members],
                tp,
                tp_rank,
                dim=first.tp_dim,
                num_groups=first.num_groups,
                padded_rows=first.padded_rows,
            )
            out[r][name] = shard.narrow(0, 0, lt.shape[0])  # padded vocab rows beyond the HF ones are not kept
    return out


def _apply(plan, src_locals, dst_layout):
    dst = {r: {n: torch.full(lt.shape, float("nan")) for n, lt in ls.items()} for r, ls in dst_layout.tensors.items()}
    for t in plan.transfers:
        view = run_view(dst[t.dst][t.dst_run.local], t.dst_run)
        view.copy_(run_view(src_locals[t.src][t.src_run.local], t.src_run).reshape(view.shape))
    return dst


CASES = {  # name: (spec kwargs, megatron kwargs, engine kwargs)
    "tp2_to_tp1": (DENSE, dict(tp=2), dict(tp=1)),
    "te_tp2pp2_to_tp2": (dict(DENSE, te_layernorm=True), dict(tp=2, pp=2), dict(tp=2)),
    "tp1dp2_to_tp2": (DENSE, dict(tp=1, dp=2), dict(tp=2)),
    "tp2pp2_to_tp2": (DENSE, dict(tp=2, pp=2), dict(tp=2)),
    "tp2_to_tp4dp2_kv_repeat": (DENSE, dict(tp=2), dict(tp=4, dp=2)),
    "ep2dp2_to_tp2": (MOE, dict(tp=1, dp=2, ep=2), dict(tp=2)),
    "tp2ep2_to_tp2dp2ep4": (MOE, dict(tp=2, ep=2, etp=1), dict(tp=2, dp=2, ep=4)),
    # expert TP (Megatron's default etp = tp): experts sharded over ETP inside each EP rank
    "tp2dp2ep2etp2_to_tp2": (MOE, dict(tp=2, dp=2, ep=2, etp=2), dict(tp=2)),
    "tp2dp2ep2etp2_to_ep2": (MOE, dict(tp=2, dp=2, ep=2, etp=2), dict(tp=1, dp=2, ep=2)),
    "grouped_tp2dp2ep2_default_etp_to_tp2": (dict(MOE, grouped_gemm=True), dict(tp=2, dp=2, ep=2), dict(tp=2)),
    "tp2pp2dp2etp2_to_ep2": (MOE, dict(tp=2, pp=2, dp=2, etp=2), dict(tp=1, dp=2, ep=2)),
    "tp2dp4ep2etp2_to_tp2": (MOE, dict(tp=2, dp=4, ep=2, etp=2), dict(tp=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_moves_exact_bytes(case):
    spec_kw, mkw, ekw = CASES[case]
    specs = gpt_specs(**spec_kw)
    src = megatron_layout(specs, **mkw)
    world = len(src.ranks)
    dst = inference_layout(specs, **ekw, ranks=range(world, world + ekw["tp"] * ekw.get("dp", 1)))
    plan = build_reshard_plan(src, dst)
    check_reshard_plan(plan)
    weights = _hf_weights(specs)
    ep, etp = mkw.get("ep", 1), mkw.get("etp", mkw["tp"])
    coords = _mcore_expert_coords(tp=mkw["tp"], dp=mkw.get("dp", 1), pp=mkw.get("pp", 1), ep=ep, etp=etp)
    src_locals = _megatron_locals(src, weights, specs, mkw["tp"], coords=coords, ep=ep, etp=etp)
    got = _apply(plan, src_locals, dst)
    want = _engine_locals(dst, weights)
    for r in dst.ranks:
        assert got[r].keys() == want[r].keys()
        for n in want[r]:
            torch.testing.assert_close(got[r][n], want[r][n], rtol=0, atol=0, msg=f"rank {r} {n}")
        # a receiver gets exactly the bytes it keeps: its local tensors, nothing more
        assert sum(t.nbytes for t in (t for t in plan.transfers if t.dst == r)) == dst.bytes_held(r)


def test_megatron_expert_names_are_local_to_the_ep_rank():
    src = megatron_layout(gpt_specs(**MOE), tp=1, dp=2, ep=2)
    names = sorted(n for n in src.tensors[1] if "layers.0.mlp.experts" in n)
    assert names == [
        f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc{k}.weight" for j in (0, 1) for k in (1, 2)
    ]
    fc1 = src.tensors[1]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert [s.name for s in fc1.segments] == [
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
    ]


def _layout_expert_coords(layout, num_experts, ep):
    """``(ep_rank, etp_rank)`` per rank as the layout places experts: read back from
    the first expert fc1 segment of layer 0 on each rank (its expert, its rows)."""
    out = {}
    for i, r in enumerate(layout.ranks):
        fc1 = [lt for n, lt in layout.tensors[r].items() if "layers.0.mlp.experts" in n and "fc1" in n]
        if not fc1:
            continue
        seg = min(fc1, key=lambda lt: lt.name).segments[0]
        expert = int(seg.name.split(".experts.")[1].split(".")[0])
        rows = seg.box.ranges[0]
        out[i] = (expert // (num_experts // ep), rows[0] // (rows[1] - rows[0]))
    return out


@pytest.mark.parametrize(
    "mkw",
    [
        dict(tp=2, dp=2, ep=2, etp=2),
        dict(tp=2, dp=1, ep=2, etp=1),
        dict(tp=2, dp=2, ep=2),
        dict(tp=2, dp=4, ep=2, etp=2),
        dict(tp=2, dp=2, ep=4, etp=1),
        dict(tp=2, dp=2, pp=2, ep=1, etp=2),
    ],
    ids=["tp2dp2ep2etp2", "tp2ep2etp1", "tp2dp2ep2_default_etp", "tp2dp4ep2etp2", "tp2dp2ep4etp1", "tp2dp2pp2etp2"],
)
def test_expert_ranks_follow_megatron_core(mkw):
    """Each rank's (EP rank, expert-TP rank) in the layout is the one megatron-core's
    expert RankGenerator gives it (order tp-ep-dp-pp, expert TP fastest)."""
    from megatron_ext.sharding import megatron_expert_coords

    layout = megatron_layout(gpt_specs(**MOE), **mkw)
    tp, dp, ep = mkw["tp"], mkw.get("dp", 1), mkw["ep"]
    etp = mkw.get("etp", tp)
    want = _mcore_expert_coords(tp=tp, dp=dp, pp=mkw.get("pp", 1), ep=ep, etp=etp)
    assert _layout_expert_coords(layout, 4, ep) == {i: want[i] for i in range(tp * dp)}  # stage 0 holds layer 0
    assert {i: megatron_expert_coords(i, tp=tp, dp=dp, ep=ep, etp=etp) for i in want} == want
    if mkw == dict(tp=2, dp=2, ep=2, etp=2):  # by hand: ranks 0..3 = (ep, etp) (0,0) (0,1) (1,0) (1,1)
        assert [want[i] for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    if mkw == dict(tp=2, dp=1, ep=2, etp=1):  # ETP 1: EP fastest, the two TP ranks are different EP ranks
        assert [want[i] for i in range(2)] == [(0, 0), (1, 0)]


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "te_grouped"])
def test_expert_tp_local_names_and_shapes(grouped):
    """Expert TP 2 (TP2 x DP2 x EP2): each rank holds its EP rank's two experts by
    their index within the rank, fc1 as ``[gate_r; up_r]`` (2F/2 x H), fc2 as H x F/2."""
    src = megatron_layout(gpt_specs(**dict(MOE, grouped_gemm=grouped)), tp=2, dp=2, ep=2, etp=2)
    for r in range(4):
        experts = {n: lt for n, lt in src.tensors[r].items() if "layers.1.mlp.experts" in n}
        m = "decoder.layers.1.mlp.experts."
        fc = [
            m + (f"linear_fc{k}.weight{j}" if grouped else f"local_experts.{j}.linear_fc{k}.weight")
            for j in (0, 1)
            for k in (1, 2)
        ]
        assert {n: lt.shape for n, lt in experts.items()} == {n: ((8, 16) if "fc1" in n else (16, 4)) for n in fc}
        fc1 = experts[fc[2]]  # local expert 1 of EP rank r // 2: global expert 2 * (r // 2) + 1
        e, half = 2 * (r // 2) + 1, r % 2
        assert [(s.name, s.box, s.row) for s in fc1.segments] == [
            (f"model.layers.1.mlp.experts.{e}.{p}_proj.weight", Box(((4 * half, 4 * half + 4), (0, 16))), 4 * k)
            for k, p in enumerate(("gate", "up"))
        ]
        assert experts[fc[3]].segments[0].box == Box(((0, 16), (4 * half, 4 * half + 4)))


def test_fused_engine_tensors_are_planned_per_part():
    specs = gpt_specs(**DENSE)
    dst = inference_layout(specs, tp=2, ranks=[2, 3])
    qkv = dst.tensors[3]["model.layers.0.self_attn.qkv_proj.weight"]
    assert [s.name.split(".")[-2] for s in qkv.segments] == ["q_proj", "k_proj", "v_proj"]
    assert qkv.segments[0].box == Box(((8, 16), (0, 16)))  # heads 2..3 of q
    assert qkv.segments[1].box == Box(((4, 8), (0, 16)))  # query group 1 of k
    src = megatron_layout(specs, tp=2)
    mqkv = src.tensors[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert [s.name.split(".")[-2] for s in mqkv.segments] == ["q_proj", "k_proj", "v_proj"]  # one group per rank
    plan = build_reshard_plan(src, dst)
    moved = [
        t
        for t in (t for t in plan.transfers if t.dst == 3)
        if t.name.endswith("qkv_proj.weight")
        or "_proj.weight" in t.name
        and "self_attn" in t.name
        and t.name.startswith("model.layers.0.")
    ]
    assert {t.src for t in moved} == {1}  # TP rank 1 of the trainer owns exactly what engine TP rank 1 keeps


def test_replicated_sources_split_the_work():
    specs = gpt_specs(**DENSE)
    src = megatron_layout(specs, tp=1, dp=4)
    dst = inference_layout(specs, tp=2, dp=2, ranks=range(4, 8))
    plan = build_reshard_plan(src, dst)
    sent = plan.sent_bytes()
    assert sorted(sent) == [0, 1, 2, 3]  # every replica serves, not just rank 0
    assert max(sent.values()) <= 1.5 * min(sent.values()), sent
    total = sum(dst.bytes_held(r) for r in dst.ranks)
    assert sum(sent.values()) == total


@pytest.mark.parametrize(
    "mk, ek",
    [
        (dict(tp=2), dict(tp=2)),
        (dict(tp=2), dict(tp=4)),
        (dict(tp=4), dict(tp=2)),
        (dict(tp=2, dp=2), dict(tp=2)),
        (dict(tp=4), dict(tp=2, dp=2)),
        (dict(tp=2, pp=2), dict(tp=2)),
    ],
    ids=["tp2-tp2", "tp2-tp4", "tp4-tp2", "tp2dp2-tp2", "tp4-tp2dp2", "tp2pp2-tp2"],
)
def test_small_replicated_tensors_come_from_a_rank_that_sends_the_shards(mk, ek, monkeypatch):
    """On other ranks, an engine rank takes the norms every TP rank holds from a rank that sends it its shards
    anyway (vectors under NEAR_BYTES: the holders by position), so it has no pair for a few bytes alone; the weights
    go exactly where the hashed rule puts them (the busiest rank sends what it sent, give or take the norms)."""
    from megatron_ext.weight_export.plan import reshard_plan

    specs = gpt_specs(**dict(DENSE, num_groups=4))  # (TP4 needs 4 query groups)
    src = megatron_layout(specs, **mk)
    n = len(src.ranks)
    dst = inference_layout(specs, **ek, ranks=range(n, n + ek["tp"] * ek.get("dp", 1)))
    plan = build_reshard_plan(src, dst)
    check_reshard_plan(plan)
    monkeypatch.setattr(reshard_plan, "NEAR_BYTES", 0)  # no tensor by position: the hashed rule alone
    hashed = build_reshard_plan(src, dst)
    nbytes = {s.name: math.prod(s.shape) * s.dtype.itemsize for s in specs}
    small = {s.name for s in specs if len(s.shape) == 1}  # the norms and biases (all under 1 MiB here)
    assert any("norm" in name for name in small) and len(small) < len(nbytes)
    for d in dst.ranks:
        large = {t.src for t in plan.transfers if t.dst == d and t.name not in small}
        assert {t.src for t in plan.transfers if t.dst == d} == large, d
    assert [t for t in plan.transfers if t.name not in small] == [t for t in hashed.transfers if t.name not in small]
    assert max(plan.sent_bytes().values()) <= max(hashed.sent_bytes().values()) + sum(nbytes[m] for m in small) * 8
    pairs = [{(t.src, t.dst) for t in p.transfers} for p in (plan, hashed)]
    assert pairs[0] <= pairs[1]
    if mk.get("dp", 1) == 1 and mk.get("pp", 1) == 1 and mk["tp"] == ek["tp"]:
        assert len(pairs[0]) < len(pairs[1])  # the hashed rule sends some norms from the other TP ranks


def test_colocated_copies_locally():
    specs = gpt_specs(**DENSE)
    src = megatron_layout(specs, tp=2)
    dst = inference_layout(specs, tp=2, vocab_padding=16)  # same ranks 0, 1; vocabulary split as Megatron's
    plan = build_reshard_plan(src, dst)
    check_reshard_plan(plan)
    assert plan.sent_bytes() == {} and plan.received_bytes() == {}


def test_mismatched_layouts_name_the_tensor():
    src = megatron_layout(gpt_specs(**DENSE), tp=1)
    dst = inference_layout(gpt_specs(**dict(DENSE, num_layers=3)), tp=1, ranks=[1])
    with pytest.raises(ValueError, match="model.layers.2"):
        build_reshard_plan(src, dst)
    with pytest.raises(ValueError, match="ep=3 x etp=1 must divide"):
        megatron_layout(gpt_specs(**MOE), dp=2, ep=3)
    with pytest.raises(ValueError, match="ep=2 x etp=2 must divide tp\\*dp=2"):
        megatron_layout(gpt_specs(**MOE), tp=2, ep=2)  # Megatron's default: expert TP = TP
    with pytest.raises(ValueError, match=r"k_proj.weight: Megatron needs num_query_groups \(2\) divisible by TP \(4\)"):
        megatron_layout(gpt_specs(**DENSE), tp=4)  # an engine repeats k / v heads instead (kv_repeat case)
    with pytest.raises(ValueError, match=r"layer_stage holds stages \[2\] outside 0..1 \(pp=2\)"):
        megatron_layout(gpt_specs(**DENSE), pp=2, layer_stage=[0, 2])


def test_fanout_waves_double_and_serve_from_updated_replicas():
    from megatron_ext.weight_export.plan.reshard_plan import fanout_plans

    specs = gpt_specs(**DENSE)
    src = megatron_layout(specs, tp=2)
    dst = inference_layout(specs, tp=2, dp=4, ranks=range(2, 10))
    replicas = [[2, 3], [4, 5], [6, 7], [8, 9]]
    plans = fanout_plans(src, dst, replicas)
    assert [p.dst.ranks for p in plans] == [(2, 3), (4, 5), (6, 7, 8, 9)]
    for p in plans:
        check_reshard_plan(p)
    assert {t.src for t in plans[0].transfers} == {0, 1}
    last = plans[2].sent_bytes()
    assert {2, 3, 4, 5} <= set(last)  # updated replicas serve the last wave, not only the trainers
    assert max(last.values()) < sum(dst.bytes_held(r) for r in (6, 7, 8, 9)) / 2
    # bytes are the same as a direct plan's: apply every wave in order
    weights = _hf_weights(specs)
    state = _megatron_locals(src, weights, specs, 2)
    for p in plans:
        got = _apply(p, state, p.dst)
        state.update(got)
    want = _engine_locals(dst, weights)
    for r in dst.ranks:
        for n in want[r]:
            torch.testing.assert_close(state[r][n], want[r][n], rtol=0, atol=0)


def test_ntp_trainer_layout_serves_from_healthy_and_degraded_replicas():
    from megatron_ext.nonuniform_tp.config import NonuniformTPConfig
    from megatron_ext.nonuniform_tp.layout import NTPLayout
    from megatron_ext.sharding import ntp_megatron_layout

    specs = gpt_specs(**dict(DENSE, padded_vocab_size=32))
    ntp = NTPLayout.from_config(NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={1: (1,)}), 3)
    src = ntp_megatron_layout(specs, ntp)  # replica 0: TP2 on ranks 0, 1; replica 1 (degraded): TP1 on rank 2
    assert src.ranks == (0, 1, 2)
    assert src.tensors[2]["decoder.layers.0.mlp.linear_fc2.weight"].shape == (16, 24)  # whole at TP1
    assert src.tensors[1]["decoder.layers.0.mlp.linear_fc2.weight"].shape == (16, 12)
    dst = inference_layout(specs, tp=2, dp=2, ranks=range(3, 7))
    plan = build_reshard_plan(src, dst)
    check_reshard_plan(plan)
    assert set(plan.sent_bytes()) == {0, 1, 2}
    # what an engine given src=None rebuilds from the recipe the trainer publishes (as JSON)
    from megatron_ext.sharding import layout_from_recipe

    for layout in (src, megatron_layout(specs, tp=2, pp=2, dp=1, ranks=[4, 5, 6, 7])):
        rebuilt = layout_from_recipe(specs, json.loads(json.dumps(layout.recipe)))
        assert rebuilt.ranks == layout.ranks and rebuilt.tensors == layout.tensors
    with pytest.raises(ValueError, match="unknown layout recipe"):
        layout_from_recipe(specs, {"kind": "fsdp"})
    weights = _hf_weights(specs)
    state = {
        **_megatron_locals(megatron_layout(specs, tp=2), weights, specs, 2),
        **{2: _megatron_locals(megatron_layout(specs, tp=1), weights, specs, 1)[0]},
    }
    got = _apply(plan, state, dst)
    want = _engine_locals(dst, weights)
    for r in dst.ranks:
        for n in want[r]:
            torch.testing.assert_close(got[r][n], want[r][n], rtol=0, atol=0)


def test_pipelined_ntp_trainer_layout_is_each_replica_at_its_degree_over_the_stages():
    """TP 2 x PP 2, replica 0 lost a GPU of stage 1 (both its stages at TP 1): stage-major ranks 0 (replica 0)
    and 1, 2 (replica 1) in stage 0, 3 and 4, 5 in stage 1. Each replica's part of the layout is Megatron's TP x PP
    layout on its ranks; a plan from it, applied in memory to hand-sharded Megatron tensors, gives every engine
    tensor exactly, served by both replicas."""
    from megatron_ext.nonuniform_tp.config import NonuniformTPConfig
    from megatron_ext.nonuniform_tp.layout import NTPLayout
    from megatron_ext.sharding import layout_from_recipe, ntp_megatron_layout

    specs = gpt_specs(**DENSE)
    cfg = NonuniformTPConfig(
        tp_base=2, tp_spares=1, non_active_ranks_per_dp={(0, 0): (1,), (0, 1): (0,)}, pipeline_model_parallel_size=2
    )
    src = ntp_megatron_layout(specs, NTPLayout.from_config(cfg, 6))
    degraded, healthy = (
        megatron_layout(specs, tp=1, pp=2, ranks=[0, 3]),
        megatron_layout(specs, tp=2, pp=2, ranks=[1, 2, 4, 5]),
    )
    assert src.tensors == {**degraded.tensors, **healthy.tensors}
    assert (
        "decoder.layers.1.mlp.linear_fc2.weight" in src.tensors[3] and not src.tensors[3].keys() & src.tensors[0].keys()
    )
    rebuilt = layout_from_recipe(specs, json.loads(json.dumps(src.recipe)))
    assert rebuilt.ranks == src.ranks and rebuilt.tensors == src.tensors
    dst = inference_layout(specs, tp=2, ranks=[6, 7])
    plan = build_reshard_plan(src, dst)
    check_reshard_plan(plan)
    assert {0, 3} & set(plan.sent_bytes()) and {1, 2, 4, 5} & set(plan.sent_bytes())
    weights = _hf_weights(specs)
    state = {**_megatron_locals(degraded, weights, specs, 1), **_megatron_locals(healthy, weights, specs, 2)}
    got, want = _apply(plan, state, dst), _engine_locals(dst, weights)
    for r in dst.ranks:
        for n in want[r]:
            torch.testing.assert_close(got[r][n], want[r][n], rtol=0, atol=0)


def _te_like_gpt(hidden=32, heads=4, groups=2, ffn=48, vocab=64, layers=2, offset=3):
    head_dim = hidden // heads

    def layer(number):
        m = nn.Module()
        m.layer_number = number
        m.self_attention = nn.Module()
        m.self_attention.linear_qkv = nn.Module()
        m.self_attention.linear_qkv.weight = nn.Parameter(torch.zeros((heads + 2 * groups) * head_dim, hidden))
        m.self_attention.linear_qkv.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        m.self_attention.linear_proj = nn.Linear(hidden, hidden, bias=False)
        m.mlp = nn.Module()
        m.mlp.linear_fc1 = nn.Module()
        m.mlp.linear_fc1.weight = nn.Parameter(torch.zeros(2 * ffn, hidden))
        m.mlp.linear_fc1.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        m.mlp.linear_fc2 = nn.Linear(ffn, hidden, bias=False)
        return m

    model = nn.Module()
    model.config = types.SimpleNamespace(
        num_moe_experts=None,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        hidden_size=hidden,
        gated_linear_unit=True,
    )
    model.share_embeddings_and_output_weights = False
    model.decoder = nn.Module()
    # A later pipeline stage: local layers 0..1 are global layers 3..4.
    model.decoder.layers = nn.ModuleList([layer(offset + j + 1) for j in range(layers)])
    model.decoder.final_layernorm = nn.Module()
    model.decoder.final_layernorm.weight = nn.Parameter(torch.ones(hidden))
    model.output_layer = nn.Module()
    model.output_layer.weight = nn.Parameter(torch.zeros(vocab, hidden))
    return model


def test_te_layer_spec_names():
    """Transformer Engine's fused layernorm names, detected from a model's parameters
    (a hand-written stand-in with TE's names: TE does not run on CPU)."""
    from megatron_ext.testing import tiny_llama
    from megatron_ext.sharding import specs_from_model

    model = _te_like_gpt()  # a later pipeline stage: global layers 3, 4 of 5
    model.config = tiny_llama.transformer_config(
        tiny_llama.TinyLlamaSpec(
            num_layers=5, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48
        )
    )
    specs = {s.name: s for s in specs_from_model(model, vocab_size=64)}
    assert (
        specs["model.layers.3.input_layernorm.weight"].megatron_name
        == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    )
    assert (
        specs["model.layers.4.post_attention_layernorm.weight"].megatron_name
        == "decoder.layers.4.mlp.linear_fc1.layer_norm_weight"
    )
    assert specs["lm_head.weight"].shape == (64, 32) and specs["lm_head.weight"].dtype == torch.float32
    # the trainer's stage holds its TE layernorms as local tensors of their own; the engine's names are HF's
    src = megatron_layout(list(specs.values()), pp=2, layer_stage=[0, 0, 0, 1, 1])
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in src.tensors[1]
    assert "decoder.layers.3.input_layernorm.weight" not in src.tensors[1]
    dst = inference_layout(list(specs.values()), tp=1, ranks=[2])
    assert "model.layers.3.input_layernorm.weight" in dst.tensors[2]
    plan = build_reshard_plan(src, dst)
    check_reshard_plan(plan)
    norm = [t for t in plan.transfers if t.dst == 2 and t.name == "model.layers.4.post_attention_layernorm.weight"]
    assert [(t.src, t.src_run.local) for t in norm] == [(1, "decoder.layers.4.mlp.linear_fc1.layer_norm_weight")]
    # a parameter the specs do not describe is named, not skipped
    model.decoder.layers[0].mlp.linear_fc1.weight0 = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"decoder\.layers\.3\.mlp\.linear_fc1\.weight0"):
        specs_from_model(model, vocab_size=64)


def _grouped_moe_like_gpt(ep_rank, *, ep=2, experts=4, hidden=32, heads=4, groups=2, ffn=8, vocab=64, layers=2):
    """EP rank ``ep_rank`` of a TE MoE GPT with TEGroupedMLP experts: a stand-in with
    TE's parameter names and shapes (TE does not run on CPU). Expert ``j`` of the
    rank (global expert ``ep_rank * experts // ep + j``) is ``linear_fc1.weight{j}``
    (``[gate; up]``) and ``linear_fc2.weight{j}``; dense weights are the same on
    every EP rank, expert weights differ."""
    import types
    import zlib

    from torch import nn

    head_dim, local = hidden // heads, experts // ep

    def param(key, *shape):
        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        return nn.Parameter(torch.randn(shape, generator=gen))

    def layer(i):
        m = nn.Module()
        m.layer_number = i + 1
        m.self_attention = nn.Module()
        m.self_attention.linear_qkv = nn.Module()
        m.self_attention.linear_qkv.weight = param(f"{i}qkv", (heads + 2 * groups) * head_dim, hidden)
        m.self_attention.linear_qkv.layer_norm_weight = param(f"{i}ln1", hidden)
        m.self_attention.linear_proj = nn.Module()
        m.self_attention.linear_proj.weight = param(f"{i}proj", hidden, heads * head_dim)
        m.pre_mlp_layernorm = nn.Module()
        m.pre_mlp_layernorm.weight = param(f"{i}ln2", hidden)
        m.mlp = nn.Module()
        m.mlp.router = nn.Module()
        m.mlp.router.weight = param(f"{i}router", experts, hidden)
        m.mlp.experts = nn.Module()
        m.mlp.experts.linear_fc1, m.mlp.experts.linear_fc2 = nn.Module(), nn.Module()
        for j in range(local):
            e = ep_rank * local + j
            m.mlp.experts.linear_fc1.register_parameter(f"weight{j}", param(f"{i}fc1e{e}", 2 * ffn, hidden))
            m.mlp.experts.linear_fc2.register_parameter(f"weight{j}", param(f"{i}fc2e{e}", hidden, ffn))
        return m

    from megatron_ext.testing import tiny_llama

    model = nn.Module()
    model.config = tiny_llama.transformer_config(
        tiny_llama.TinyLlamaSpec(
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            ffn_hidden_size=48,
        ),
        num_moe_experts=experts,
        moe_ffn_hidden_size=ffn,
        moe_router_topk=2,
        moe_grouped_gemm=True,
    )
    model.vocab_size = vocab
    model.share_embeddings_and_output_weights = False
    model.embedding = nn.Module()
    model.embedding.word_embeddings = nn.Module()
    model.embedding.word_embeddings.weight = param("emb", vocab, hidden)
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList([layer(i) for i in range(layers)])
    model.decoder.final_layernorm = nn.Module()
    model.decoder.final_layernorm.weight = param("norm", hidden)
    model.output_layer = nn.Module()
    model.output_layer.weight = param("out", vocab, hidden)
    return types.SimpleNamespace(module=model)  # unwrapped like a DDP wrapper


def _grouped_hf(params, *, ep=2, experts=4, ffn=8, layers=2, heads=4, groups=2, hidden=32):
    """HF tensors by hand from the EP ranks' TEGroupedMLP parameters (``params[r]``)."""
    p0, hd = params[0], hidden // heads
    ref = {
        "model.embed_tokens.weight": p0["embedding.word_embeddings.weight"],
        "lm_head.weight": p0["output_layer.weight"],
        "model.norm.weight": p0["decoder.final_layernorm.weight"],
    }
    for i in range(layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = p0[m + "self_attention.linear_qkv.weight"].view(groups, (heads // groups + 2) * hd, hidden)
        q = heads // groups * hd
        ref[h + "self_attn.q_proj.weight"] = qkv[:, :q].reshape(-1, hidden)
        ref[h + "self_attn.k_proj.weight"] = qkv[:, q : q + hd].reshape(-1, hidden)
        ref[h + "self_attn.v_proj.weight"] = qkv[:, q + hd :].reshape(-1, hidden)
        ref[h + "self_attn.o_proj.weight"] = p0[m + "self_attention.linear_proj.weight"]
        ref[h + "input_layernorm.weight"] = p0[m + "self_attention.linear_qkv.layer_norm_weight"]
        ref[h + "post_attention_layernorm.weight"] = p0[m + "pre_mlp_layernorm.weight"]
        ref[h + "mlp.gate.weight"] = p0[m + "mlp.router.weight"]
        for e in range(experts):
            p, j = params[e // (experts // ep)], e % (experts // ep)
            fc1 = p[m + f"mlp.experts.linear_fc1.weight{j}"]
            ref[h + f"mlp.experts.{e}.gate_proj.weight"] = fc1[:ffn]
            ref[h + f"mlp.experts.{e}.up_proj.weight"] = fc1[ffn:]
            ref[h + f"mlp.experts.{e}.down_proj.weight"] = p[m + f"mlp.experts.linear_fc2.weight{j}"]
    return ref


@pytest.mark.parametrize("engine", [dict(tp=2), dict(tp=1, dp=2, ep=2)], ids=["tp2", "ep2"])
def test_grouped_gemm_expert_names(engine):
    """TEGroupedMLP's per-expert names (``linear_fc1.weight{j}``), detected from a
    model's parameters: the trainer layout's local tensors are exactly the
    parameters of each EP rank, and a plan moves their bytes exactly."""
    from megatron_ext.sharding import specs_from_model
    from megatron_ext.weight_export.exec.reshard import megatron_tensors

    models = [_grouped_moe_like_gpt(r) for r in range(2)]
    specs = specs_from_model(models[0], vocab_size=64)
    assert specs == specs_from_model(models[1], vocab_size=64)
    by_name = {s.name: s for s in specs}
    assert (
        by_name["model.layers.1.mlp.experts.3.up_proj.weight"].megatron_name
        == "decoder.layers.1.mlp.experts.linear_fc1.weight3"
    )  # global index in the specs
    src = megatron_layout(specs, tp=1, dp=2, ep=2)
    params = [megatron_tensors(m) for m in models]
    for r in range(2):  # the layout's local tensors are the rank's parameters: names (local expert index), shapes
        assert {n: lt.shape for n, lt in src.tensors[r].items()} == {n: tuple(t.shape) for n, t in params[r].items()}
    fc1 = src.tensors[1]["decoder.layers.0.mlp.experts.linear_fc1.weight0"]
    assert [s.name for s in fc1.segments] == [
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
    ]
    dst = inference_layout(specs, **engine, ranks=[2, 3])
    plan = build_reshard_plan(src, dst)
    check_reshard_plan(plan)
    got = _apply(plan, {r: {n: t.detach() for n, t in params[r].items()} for r in range(2)}, dst)
    want = _engine_locals(dst, _grouped_hf(params))
    for r in dst.ranks:
        assert got[r].keys() == want[r].keys()
        for n in want[r]:
            torch.testing.assert_close(got[r][n], want[r][n], rtol=0, atol=0, msg=f"rank {r} {n}")


def test_unsupported_expert_layouts_name_the_parameter():
    """Expert weights with no Qwen3-MoE form, and an expert shard split on another dim than
    Megatron's expert linears, are refused naming the parameter (never skipped or misplaced)."""
    from torch import nn

    from megatron_ext.sharding import UnsupportedParameter, specs_from_model

    for attr, shape, match in (
        ("weight1", (32, 32), "legacy GroupedMLP"),  # (hidden, local experts * 2 ffn)
        ("weight", (2, 16, 32), "moe_single_grouped_weight"),
        ("bias0", (16,), "add_bias_linear=False"),
        ("bias", (16,), "add_bias_linear=False"),
    ):
        model = _grouped_moe_like_gpt(0)
        target = model.module.decoder.layers[1].mlp.experts
        if attr == "weight1":
            target.register_parameter("weight1", nn.Parameter(torch.zeros(shape)))
            name = "decoder.layers.1.mlp.experts.weight1"
        else:
            if attr == "weight":
                target.linear_fc1 = nn.Module()
            target.linear_fc1.register_parameter(attr, nn.Parameter(torch.zeros(shape)))
            name = f"decoder.layers.1.mlp.experts.linear_fc1.{attr}"
        with pytest.raises(UnsupportedParameter, match=rf"{name}'.*{match}"):
            specs_from_model(model, vocab_size=64)
    model = _grouped_moe_like_gpt(0)
    fc2 = model.module.decoder.layers[0].mlp.experts.linear_fc2.weight1
    fc2.tensor_model_parallel, fc2.partition_dim = True, 0
    with pytest.raises(
        UnsupportedParameter,
        match=r"decoder\.layers\.0\.mlp\.experts\.linear_fc2\.weight1: split on "
        r"dim 0 .* shards it on dim 1",
    ):
        specs_from_model(model, vocab_size=64)


def test_interleaved_glu_experts_are_refused():
    """TEGroupedMLP with ``moe_mlp_glu_interleave_size`` interleaves gate and up rows:
    describing fc1 as [gate; up] would move the wrong rows, so the layout refuses."""
    from megatron_ext.sharding import specs_from_model

    model = _grouped_moe_like_gpt(0)
    model.module.config.moe_mlp_glu_interleave_size = 32
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size=32"):
        specs_from_model(model, vocab_size=64)


def test_specs_round_trip_through_json():
    """What a trainer publishes to an engine that has no model description (TrainerRefit -> EngineRefit with
    src=None): every field back, fused (kind, part) and expert tensors included; anything else is refused."""
    from megatron_ext.sharding import TensorSpec

    specs = gpt_specs(**MOE)
    back = [TensorSpec.from_json(json.loads(json.dumps(s.to_json()))) for s in specs]
    assert back == specs and any(s.fused for s in back) and any(s.expert is not None for s in back)
    with pytest.raises(ValueError, match="not a TensorSpec description"):
        TensorSpec.from_json({**specs[0].to_json(), "dtype": "Tensor"})  # a torch attribute that is no dtype
    with pytest.raises(ValueError, match="not a TensorSpec description"):
        TensorSpec.from_json({"name": "x"})


def test_planning_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """The plan and both layout builders run with the cyclic collector paused (a full pass over a training
    process's heap inside the plan cost 260 ms on CPU; Qwen3-235B's engine layout took 2.3 s with it, 1.1 s
    without) and leave it as they found it: on, off, and on after an error."""
    import gc

    from megatron_ext.sharding import megatron as sharding_megatron
    from megatron_ext.weight_export.plan import layout as plan_layout
    from megatron_ext.weight_export.plan import reshard_plan

    seen, cells = [], reshard_plan._cells
    monkeypatch.setattr(reshard_plan, "_cells", lambda *a: seen.append(gc.isenabled()) or cells(*a))
    built, local = [], sharding_megatron.local_tensors
    for module in (sharding_megatron, plan_layout):
        monkeypatch.setattr(module, "local_tensors", lambda *a, **k: built.append(gc.isenabled()) or local(*a, **k))
    src, dst = megatron_layout(gpt_specs(**DENSE), tp=1), inference_layout(gpt_specs(**DENSE), tp=1, ranks=[1])
    assert len(built) == 2 and not any(built)  # one local_tensors call per builder, the collector paused
    assert gc.isenabled()
    assert build_reshard_plan(src, dst).transfers and seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        build_reshard_plan(src, dst)
        assert not gc.isenabled()  # left off
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="model.layers.2"):
        build_reshard_plan(src, inference_layout(gpt_specs(**dict(DENSE, num_layers=3)), tp=1, ranks=[1]))
    assert gc.isenabled()


def test_replicated_experts_split_evenly_and_every_process_plans_alike():
    """Replicated holders are chosen by a rule of the layouts alone: colocated TP2 x EP2 x DP2 -> TP1 x EP4
    sends within 5% of the same bytes from every rank (least-loaded, the rule before, left one rank 25%
    above the others on the 3b MoE preset), and two processes with other string hashes plan the same
    transfers (a rank that planned differently would be refused at the first refit)."""
    import os
    import subprocess
    import sys

    specs = gpt_specs(**MOE)
    plan = build_reshard_plan(megatron_layout(specs, tp=2, dp=2, ep=2), inference_layout(specs, tp=1, dp=4, ep=4))
    sent = plan.sent_bytes()
    assert sorted(sent) == [0, 1, 2, 3] and max(sent.values()) <= 1.05 * min(sent.values()), sent
    code = (
        "import torch;"
        "from megatron_ext.sharding import gpt_specs, megatron_layout;"
        "from megatron_ext.weight_export.plan.layout import inference_layout;"
        "from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan;"
        f"s = gpt_specs(**{MOE!r});"
        "src, dst = megatron_layout(s, tp=2, dp=2, ep=2), inference_layout(s, tp=1, dp=4, ep=4);"
        "print(build_reshard_plan(src, dst).fingerprint)"
    )
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == plan.fingerprint, (seed, out.stderr[-2000:])


@pytest.mark.parametrize("alike", ["templates", "by-rule"])
def test_a_ranks_plan_is_the_whole_plans_transfers_of_that_rank(alike, monkeypatch):
    """``build_reshard_plan(src, dst, rank=r)`` (what rank ``r`` of the job plans) holds exactly the whole plan's
    transfers that ``r`` sends, receives or copies, in the whole plan's order, for every rank of every layout
    pair here: the test cases on separate ranks and colocated, replicated holders (data-parallel trainers, expert
    replicas, colocated engines), engine replicas that share their local tensors, and a fan-out wave's merged
    sources, whole HF tensors from Megatron's fused ones and back. (A rank's plan takes tensors alike from one template:
    each of these differs from another in one of the things that make them alike; ``by-rule``: every tensor worked
    out by the rule alone, as those of more than ``ALIKE_MAX_HOLDINGS`` holdings are.)"""
    from megatron_ext.weight_export.plan import reshard_plan
    from megatron_ext.weight_export.plan.reshard_plan import fanout_plans

    if alike == "by-rule":
        monkeypatch.setattr(reshard_plan, "ALIKE_MAX_HOLDINGS", 0)

    pairs = []
    for spec_kw, mkw, ekw in CASES.values():
        specs = gpt_specs(**spec_kw)
        src = megatron_layout(specs, **mkw)
        n = ekw["tp"] * ekw.get("dp", 1)
        pairs.append((src, inference_layout(specs, **ekw, ranks=range(len(src.ranks), len(src.ranks) + n))))
        pairs.append((src, inference_layout(specs, **ekw, ranks=range(n))))  # colocated on the first ranks
    specs = gpt_specs(**MOE)
    pairs.append((megatron_layout(specs, tp=2, dp=2, ep=2), inference_layout(specs, tp=1, dp=4, ep=4)))
    pairs.append((megatron_layout(specs, tp=1, dp=4), inference_layout(specs, tp=2, dp=3, ranks=range(1, 7))))
    dense = gpt_specs(**DENSE)
    dst = inference_layout(dense, tp=2, dp=4, ranks=range(2, 10))
    pairs += [(p.src, p.dst) for p in fanout_plans(megatron_layout(dense, tp=2), dst, [[2, 3], [4, 5], [6, 7], [8, 9]])]
    # whole HF tensors from Megatron's fused ones: gate and up alike but for their rows in the trainer's [gate; up]
    pairs += [(megatron_layout(dense, tp=2), whole_layout(dense, rank=r)) for r in (2, 1)]
    pairs.append((whole_layout(dense, rank=0), inference_layout(dense, tp=2, ranks=[1, 2])))  # ... and back, fused
    checked = expected = 0
    for src, dst in pairs:
        whole = build_reshard_plan(src, dst)
        expected += sum(1 if t.src == t.dst else 2 for t in whole.transfers)  # in its sender's and receiver's plan
        for r in sorted({*src.ranks, *dst.ranks, max(*src.ranks, *dst.ranks) + 1}):
            mine = build_reshard_plan(src, dst, rank=r)
            assert mine.rank == r
            assert mine.transfers == [t for t in whole.transfers if r in (t.src, t.dst)], (src.description, r)
            checked += len(mine.transfers)
    assert checked == expected > 3000
    # a rank's plan of layouts no source completes is refused by name as the whole plan is
    with pytest.raises(ValueError, match="model.layers.2"):
        build_reshard_plan(
            megatron_layout(dense, tp=1), inference_layout(gpt_specs(**dict(DENSE, num_layers=3)), ranks=[1]), rank=1
        )


def test_a_runs_view_is_placed_by_the_tensors_own_offset_and_refuses_a_strided_tensor():
    """``run_view`` is one ``as_strided`` over the storage: a tensor that starts inside its storage (a slice of
    a larger one) gives the run's elements of that tensor, not of the storage's start; a tensor that is not
    contiguous is refused (its flat offsets would name other elements)."""
    from megatron_ext.weight_export.plan.reshard_plan import Run

    storage = torch.arange(100.0)
    tensor = storage[10:70].view(6, 10)  # storage offset 10
    run = Run("w", offset=12, length=3, stride=10, count=4)  # rows 1..4, columns 2..4
    got = run_view(tensor, run)
    assert torch.equal(got, tensor[1:5, 2:5]) and got.data_ptr() == tensor[1, 2].data_ptr()
    with pytest.raises(ValueError, match="w: a run's view needs a contiguous tensor"):
        run_view(tensor.t(), run)
