"""Export from a nonuniform-TP job: the exporting replica is healthy (TP=2, the
degraded replica's partner), the other replica is degraded (TP=1; it takes its
partner's weights when the exporter refreshes it). Right after an optimizer step,
the weights the HF receiver gets equal the degraded replica's full model, and
logits match."""

import torch

from megatron_ext.testing import tiny_gpt, tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

from ._reference import gathered_hf_state, hf_state_from_megatron, pipelined_ntp_job

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")
# Replica 1 lost TP slot 1: packed ranks 0,1 = healthy replica 0 (TP=2), rank 2 = replica 1 (TP=1).
NTP = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={1: (1,)})


def _inprocess_exporter(ddp):
    """``(receiver, exporter)``: the export hook into an HF model in this process, in small buckets."""
    from megatron_ext import weight_export as wx

    receiver = wx.WeightReceiver(wx.HFModelConsumer(tiny_llama.build_hf(SPEC)))
    config = wx.RefitConfig(transport="inprocess", bucket_size_mb=0.02, vocab_size=SPEC.hf_vocab_size)
    return receiver, wx.WeightExporter(ddp, config, receiver=receiver)


def _ntp_trainer(steps):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel
    from megatron_ext.testing.ntp_job import init_job

    job = init_job(NTP)
    cfg = tiny_llama.transformer_config(SPEC, tp=ps.get_tensor_model_parallel_world_size())
    model = tiny_llama.build_model(SPEC, cfg)
    ddp = NonuniformTPDistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, ntp_config=job.ntp_config
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [ddp])
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    per_replica = 4 // job.replicas
    mine = slice(job.replica * per_replica, (job.replica + 1) * per_replica)
    for step in range(steps):
        tokens, labels = tiny_gpt.global_batch(SPEC, step, 4)
        tiny_gpt.train_step(ddp, opt, tokens[mine], labels[mine])
    # No forward or zero_grad_buffer since the last step: the degraded replica's
    # weights are stale until the exporter refreshes them (its partner sends them).
    receiver, exporter = _inprocess_exporter(ddp)
    result = exporter.export(version=steps)
    verify = exporter.verify(tiny_llama.tokens(SPEC))
    out = dict(
        replica=job.replica,
        degraded=job.degraded,
        export_rank=exporter.is_export_rank,
        applied=result.applied,
        verify=verify,
    )
    if exporter.is_export_rank:
        out["received"] = {n: p.detach().clone() for n, p in receiver.consumer.model.named_parameters()}
    if job.degraded:  # TP=1: this rank holds the whole trained model
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        kw = dict(
            num_layers=SPEC.num_layers,
            num_heads=SPEC.num_attention_heads,
            num_groups=SPEC.num_query_groups,
            hidden=SPEC.hidden_size,
            vocab=SPEC.hf_vocab_size,
            tied=SPEC.tie_embeddings,
        )
        out["reference"] = hf_state_from_megatron(full, **kw)
        out["initial"] = hf_state_from_megatron(init, **kw)
    return out


def test_healthy_ntp_replica_exports_the_trained_model():
    out = run_on_ranks(_ntp_trainer, 3, args=(3,), timeout=300)
    exporter = next(o for o in out if o["export_rank"])
    degraded = next(o for o in out if o["degraded"])
    assert exporter["replica"] == 0 and not exporter["degraded"]
    assert exporter["applied"] == (3,)
    received, reference = exporter["received"], degraded["reference"]
    assert received.keys() == reference.keys()
    for name, want in reference.items():
        assert not torch.equal(want, degraded["initial"][name]) or "norm" in name, f"{name} did not train"
        assert torch.allclose(received[name], want, rtol=0, atol=1e-6), (
            f"{name}: max diff {(received[name] - want).abs().max().item():.2e}"
        )
    assert exporter["verify"].max_abs_diff < 1e-4 and exporter["verify"].kl < 1e-6, exporter["verify"]


# With pipeline stages (TP 2 x PP 2): replica 0 lost slot 1 of stage 0, so it runs both stages at TP 1 (ranks 0 and
# 3, stage-major) as the satellite of replica 1 (ranks 1, 2 and 4, 5).
NTP_PP = dict(
    tp_base=2, tp_spares=1, non_active_ranks_per_dp={(0, 0): (1,), (0, 1): (1,)}, pipeline_model_parallel_size=2
)


def _pipelined_ntp_trainer(steps):
    """Train ``steps`` steps through Megatron's 1F1B schedule, then export through the hook: replica 0 (the
    degraded one: its stage leaders are its TP 1 ranks, refreshed from the partner by the exporter) exports."""
    import torch.distributed as dist

    job, model, ddp = pipelined_ntp_job(SPEC, NTP_PP, steps)
    receiver, exporter = _inprocess_exporter(ddp)
    result = exporter.export(version=steps)
    out = dict(rank=dist.get_rank(), replica=job.replica, degraded=job.degraded, export_rank=exporter.is_export_rank)
    out["applied"] = result.applied
    if exporter.is_export_rank:
        out["received"] = {n: p.detach().clone() for n, p in receiver.consumer.model.named_parameters()}
    # the healthy replica's stepped weights (what its optimizer holds), gathered over its TP and PP groups
    healthy = gathered_hf_state(SPEC, model)  # collective within each replica
    out["healthy"] = None if job.degraded else healthy
    return out


def test_pipelined_ntp_job_exports_the_trained_model():
    """TP 2 x PP 2 with replica 0 degraded to TP 1 in both stages: 2 steps through the 1F1B schedule, then the
    export hook. The export rank is replica 0's (DP rank 0: the degraded replica, its stages' leaders its TP 1
    ranks, whose weights the exporter refreshes from the partner: without that they would hold step 1's). The
    receiver holds exactly the healthy replica's stepped weights (gathered over its TP 2 ranks), the two stages'
    layers under their global numbers."""
    out = run_on_ranks(_pipelined_ntp_trainer, 6, args=(2,), timeout=300)
    exporter = next(o for o in out if o["export_rank"])
    assert exporter["rank"] == 0 and exporter["degraded"] and exporter["applied"] == (2,)
    reference = next(o["healthy"] for o in out if o["healthy"] is not None)  # replica 1's, the same on its ranks
    received = exporter["received"]
    assert received.keys() == reference.keys()
    bad = {n: (received[n] - w).abs().max().item() for n, w in reference.items() if not torch.equal(received[n], w)}
    assert not bad, bad
