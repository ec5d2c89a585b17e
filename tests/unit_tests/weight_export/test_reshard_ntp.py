"""Reshard refit from a real nonuniform-TP trainer (packed: ranks 0, 1 = healthy
replica 0 at TP2, rank 2 = replica 1 degraded to TP1) that trains with
``NonuniformTPDistributedDataParallel`` and Megatron's optimizer, to engine
layouts colocated on the same ranks (TP1 x DP3 and TP2 on ranks 1, 2).

Right after an optimizer step the degraded replica's weights are stale (the
optimizer steps its healthy partner's; the partner sends them before the next
forward); ``ntp_megatron_tensors`` and the executor's ``refresh`` serve the stepped
weights. Every engine tensor equals, exactly, a hand conversion of the degraded
replica's own TP1 parameters once refreshed (the trained model, independent of the
layout code), at two versions with one plan; the plan serves from healthy and
degraded ranks; without ``refresh`` the degraded rank would serve the previous step;
``ddp.module`` (empty on the degraded rank) is refused."""

import pytest
import torch

from megatron_ext.testing import tiny_gpt, tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

from ._reference import gathered_hf_state, hf_state_from_megatron, pipelined_ntp_job

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")  # QKV bias: a fused 1-D tensor too
NTP = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={1: (1,)})
HEALTHY, DEGRADED = (0, 1), 2
ENGINES = {"tp1dp3": dict(tp=1, dp=3, ranks=[0, 1, 2]), "tp2": dict(tp=2, ranks=[1, 2])}
BUCKET = 4096  # small buckets: several rounds


def _hf(state):
    return hf_state_from_megatron(
        state,
        num_layers=SPEC.num_layers,
        num_heads=SPEC.num_attention_heads,
        num_groups=SPEC.num_query_groups,
        hidden=SPEC.hidden_size,
        vocab=SPEC.hf_vocab_size,
        tied=SPEC.tie_embeddings,
    )


def _body(backend):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext import weight_export as wx
    from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel, get_ntp_process_groups
    from megatron_ext.testing.ntp_job import init_job

    job = init_job(NTP)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    cfg = tiny_llama.transformer_config(SPEC, tp=ps.get_tensor_model_parallel_world_size())
    model = tiny_llama.build_model(SPEC, cfg, device=device)
    ddp = NonuniformTPDistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, ntp_config=job.ntp_config
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [ddp])
    per_replica = 4 // job.replicas
    mine = slice(job.replica * per_replica, (job.replica + 1) * per_replica)

    def step(i):
        tokens, labels = tiny_gpt.global_batch(SPEC, i, 4)
        tiny_gpt.train_step(ddp, opt, tokens[mine].to(device), labels[mine].to(device))

    def reference():  # the degraded replica (TP1) holds the whole trained model
        return _hf({n: p.detach().cpu() for n, p in model.named_parameters()}) if job.degraded else None

    def snap(tensors):
        return {n: t.cpu().clone() for n, t in tensors.items()}

    out = dict(healthy=ddp.ntp_role != "degraded", degraded=job.degraded, reference={0: reference()})
    for i in range(2):
        step(i)
    # no forward since the step: the degraded replica's weights still hold step 0's values
    stale = snap(wx.megatron_tensors(ddp))
    specs = wx.specs_from_model(ddp, vocab_size=SPEC.hf_vocab_size)
    src = wx.ntp_megatron_layout(specs, get_ntp_process_groups().layout)
    tensors = wx.ntp_megatron_tensors(ddp)  # takes the partner's weights (collective over the pair)
    out["refreshed"] = sorted(n for n in tensors if not torch.equal(stale[n], tensors[n].cpu()))
    out["specs"] = specs == wx.specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)
    out["reference"][1] = reference()
    shadow = {n: p.detach() for n, p in ddp.module.named_parameters()}  # empty on the degraded rank
    executors, engines = {}, {}
    for case, kw in ENGINES.items():
        plan = wx.build_reshard_plan(src, wx.inference_layout(specs, **kw))
        engines[case] = {
            n: torch.full(lt.shape, float("nan"), device=device) for n, lt in plan.dst.tensors.get(rank, {}).items()
        }
        executors[case] = wx.ReshardExecutor(
            plan, rank, {**tensors, **engines[case]}, bucket_bytes=BUCKET, refresh=ddp.refresh_compute_params
        )
        out[case, 1] = dict(stats=executors[case].refit(1), engine=snap(engines[case]))
        if case == "tp1dp3":
            try:  # ddp.module lacks the degraded rank's tensors: every rank refuses the refit
                wx.ReshardExecutor(plan, rank, {**shadow, **engines[case]}).refit(1)
                out["shadow_error"] = None
            except wx.RefitRejected as err:
                out["shadow_error"] = (err.reason, str(err))
    # one more step, same plans and executors: without refresh the degraded rank would serve the last version
    step(2)
    plan = executors["tp1dp3"].plan
    no_refresh = {n: torch.full_like(t, float("nan")) for n, t in engines["tp1dp3"].items()}
    wx.ReshardExecutor(plan, rank, {**tensors, **no_refresh}, bucket_bytes=BUCKET).refit(2)
    out["no_refresh"] = snap(no_refresh)
    for case, ex in executors.items():
        out[case, 2] = dict(stats=ex.refit(2), engine=snap(engines[case]))
    out["reference"][2] = reference()  # refreshed by the refits
    return out


def _cut(ref, seg_name, box):
    return ref[seg_name][tuple(slice(a, b) for a, b in box.ranges)]


def _check(engine, ref, dst, r, label):
    """``engine`` (rank ``r``'s local tensors) equals the HF weights cut by the engine layout."""
    for n, lt in dst.tensors[r].items():
        want = torch.cat([_cut(ref, s.name, s.box) for s in lt.segments])
        torch.testing.assert_close(engine[n], want, rtol=0, atol=0, msg=f"{label} rank {r} {n}")


def _engine_part(engine, t):
    """The part of the engine tensors that transfer ``t`` wrote, shaped as its HF box."""
    from megatron_ext.weight_export.plan.reshard_plan import run_view

    return run_view(engine[t.dst_run.local].contiguous(), t.dst_run).reshape(t.box.shape)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(3))])
def test_ntp_trainer_refit_exact(backend):
    from megatron_ext.nonuniform_tp import NonuniformTPConfig, NTPLayout
    from megatron_ext.weight_export import build_reshard_plan, inference_layout, ntp_megatron_layout, specs_from_config

    results = run_on_ranks(_body, 3, args=(backend,), backend=backend, timeout=300)
    assert [r["healthy"] for r in results] == [True, True, False] and results[DEGRADED]["degraded"]
    assert all(r["specs"] for r in results)
    refs = results[DEGRADED]["reference"]
    cfg = tiny_llama.transformer_config(SPEC)
    specs = specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)
    src = ntp_megatron_layout(specs, NTPLayout.from_config(NonuniformTPConfig(**NTP), 3))
    # the refresh changed every tensor of the degraded rank (its partner's step); healthy: nothing to do
    assert results[DEGRADED]["refreshed"] == sorted(src.tensors[DEGRADED])
    for r in HEALTHY:
        assert results[r]["refreshed"] == [], r
    # ddp.module of the degraded rank is empty: refused on every rank, naming the way out
    for r in range(3):
        reason, msg = results[r]["shadow_error"]
        assert reason == "tensors" and "ntp_megatron_tensors" in msg, msg
        # the healthy ranks' modules are their tensors: no problem of their own, they name the degraded rank
        assert msg.startswith(f"rank {r}: " + ("" if r == DEGRADED else "ranks [2] cannot take part")), msg
    for case, kw in ENGINES.items():
        plan = build_reshard_plan(src, inference_layout(specs, **kw))
        dst = plan.dst
        served = {t.src for t in plan.transfers if t.src != t.dst}
        # the plan spreads the load over both replicas: healthy and degraded ranks serve
        assert served & set(HEALTHY) and DEGRADED in served, (case, served)
        for v in (1, 2):
            for r in dst.ranks:
                res = results[r][case, v]
                _check(res["engine"], refs[v], dst, r, f"{case} v{v}")
                assert res["stats"].received_bytes >= plan.received_bytes().get(r, 0)
            # bytes any rank served are the stepped weights, not the previous version's
            for t in plan.transfers:
                if t.src != t.dst:
                    got = _engine_part(results[t.dst][case, v]["engine"], t)
                    assert torch.equal(got, _cut(refs[v], t.name, t.box))
                    assert not torch.equal(got, _cut(refs[v - 1], t.name, t.box)), (case, v, t.name, t.box)
    # without refresh, the degraded rank serves (and copies locally) step 1's weights; the healthy ranks step 2's
    plan = build_reshard_plan(src, inference_layout(specs, **ENGINES["tp1dp3"]))
    for t in plan.transfers:
        got = _engine_part(results[t.dst]["no_refresh"], t)
        want = refs[1] if t.src == DEGRADED else refs[2]
        assert torch.equal(got, _cut(want, t.name, t.box)), (t.src, t.dst, t.name)


# With pipeline stages (TP 2 x PP 2): replica 0 lost slot 1 of stage 0 and runs both stages at TP 1 (ranks 0 and 3,
# stage-major), the satellite of replica 1 (ranks 1, 2 and 4, 5). The engine: TP 2 on ranks 1 and 4 (colocated on
# the healthy replica's first TP rank of each stage).
NTP_PP = dict(
    tp_base=2, tp_spares=1, non_active_ranks_per_dp={(0, 0): (1,), (0, 1): (1,)}, pipeline_model_parallel_size=2
)
PP_ENGINE = dict(tp=2, ranks=[1, 4])


def _pipelined_body():
    import torch.distributed as dist

    from megatron_ext import weight_export as wx
    from megatron_ext.nonuniform_tp import get_ntp_process_groups

    job, model, ddp = pipelined_ntp_job(SPEC, NTP_PP, 2)
    rank = dist.get_rank()
    specs = wx.specs_from_config(ddp.config, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)
    plan = wx.build_reshard_plan(
        wx.ntp_megatron_layout(specs, get_ntp_process_groups().layout), wx.inference_layout(specs, **PP_ENGINE)
    )
    engine = {n: torch.full(lt.shape, float("nan")) for n, lt in plan.dst.tensors.get(rank, {}).items()}
    # the degraded ranks serve their partner's weights of the last step (the executor refreshes them first)
    ex = wx.ReshardExecutor(
        plan, rank, {**wx.ntp_megatron_tensors(ddp), **engine}, bucket_bytes=BUCKET, refresh=ddp.refresh_compute_params
    )
    ex.refit(1)
    healthy = gathered_hf_state(SPEC, model)  # the healthy replica's stepped weights (collective within a replica)
    return dict(rank=rank, engine={n: t.clone() for n, t in engine.items()}, healthy=None if job.degraded else healthy)


def test_pipelined_ntp_trainer_refit_exact():
    """TP 2 x PP 2 with replica 0 degraded to TP 1 in both stages, 2 steps through the 1F1B schedule, then one
    reshard refit (gloo) to a TP 2 engine colocated on ranks 1 and 4: every engine tensor equals the healthy
    replica's stepped weights cut by the engine layout, and the plan serves from degraded and healthy ranks of
    both stages."""
    from megatron_ext.nonuniform_tp import NonuniformTPConfig, NTPLayout
    from megatron_ext.weight_export import build_reshard_plan, inference_layout, ntp_megatron_layout, specs_from_config

    results = run_on_ranks(_pipelined_body, 6, timeout=300)
    ref = next(r["healthy"] for r in results if r["healthy"] is not None)
    cfg = tiny_llama.transformer_config(SPEC, pp=2, pipeline_dtype=torch.float32)
    specs = specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)
    src = ntp_megatron_layout(specs, NTPLayout.from_config(NonuniformTPConfig(**NTP_PP), 6))
    plan = build_reshard_plan(src, inference_layout(specs, **PP_ENGINE))
    served = {t.src for t in plan.transfers}
    assert served & {0, 3} and served & {1, 2, 4, 5}, served
    for r in plan.dst.ranks:
        _check(results[r]["engine"], ref, plan.dst, r, "pipelined NTP")
