"""Export from a nonuniform-TP job: the exporting replica is healthy (TP=2, the
degraded replica's partner), the other replica is degraded (TP=1; it takes its
partner's weights when the exporter refreshes it). Right after an optimizer step,
the weights the HF receiver gets equal the degraded replica's full model, and
logits match."""

import torch

from megatron_ext.testing import tiny_gpt, tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

from ._reference import hf_state_from_megatron

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")
# Replica 1 lost TP slot 1: packed ranks 0,1 = healthy replica 0 (TP=2), rank 2 = replica 1 (TP=1).
NTP = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={1: (1,)})


def _ntp_trainer(steps):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext import weight_export as wx
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
    receiver = wx.WeightReceiver(wx.HFModelConsumer(tiny_llama.build_hf(SPEC)))
    exporter = wx.WeightExporter(
        ddp,
        wx.RefitConfig(transport="inprocess", bucket_size_mb=0.02, vocab_size=SPEC.hf_vocab_size),
        receiver=receiver,
    )
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
