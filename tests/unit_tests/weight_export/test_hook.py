"""The training-script hook: a Megatron DDP + optimizer training loop exporting every N steps with version
numbers (the config and its flags: test_refit_config.py)."""

import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

from ._reference import reference_for

SPEC = tiny_llama.TinyLlamaSpec()


def _gathered_hf_state(model):
    """The model's weights via per-parameter TP all-gathers, converted by the test's reference."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    full = {}
    for name, p in model.module.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            if name.endswith("linear_fc1.weight"):
                parts = [x.chunk(2)[0] for x in parts] + [x.chunk(2)[1] for x in parts]
                t = torch.cat(parts, 0)
            else:
                t = torch.cat(parts, p.partition_dim)
        full[name] = t

    class _Full(torch.nn.Module):
        def named_parameters(self, *a, **k):
            return iter(full.items())

    return reference_for(SPEC, _Full())


def _train_and_export(steps, every):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = tiny_llama.transformer_config(SPEC, tp=2)
    model = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=tiny_llama.build_model(SPEC, cfg),
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model])
    hf = tiny_llama.hf_model(SPEC, cfg)
    receiver = wx.WeightReceiver(wx.HFModelConsumer(hf))
    exporter = wx.WeightExporter(
        model, wx.RefitConfig(every_n_steps=every, vocab_size=SPEC.hf_vocab_size), receiver=receiver
    )
    tokens = tiny_llama.tokens(SPEC, batch=2, seed=1)
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    reported, exported_state = [], None
    for step in range(1, steps + 1):
        model.zero_grad_buffer()
        opt.zero_grad()
        labels = torch.roll(tokens, -1, dims=1)
        model(tokens, torch.arange(seq).expand_as(tokens), mask, labels=labels).float().mean().backward()
        model.finish_grad_sync()
        opt.step()
        result = exporter.maybe_export(step)
        if result is not None:
            reported.append(result.applied)
            exported_state = _gathered_hf_state(model)
    final_state = _gathered_hf_state(model)
    return dict(
        reported=reported,
        applied=receiver.applied_version,
        state={n: p.detach().clone() for n, p in hf.named_parameters()},
        exported=exported_state,
        final=final_state,
    )


def test_training_loop_exports_every_n_steps_with_versions():
    out = run_on_ranks(_train_and_export, 2, args=(5, 2), backend="gloo", timeout=240)
    rank0 = out[0]
    assert rank0["reported"] == [(2,), (4,)]
    assert rank0["applied"] == 4
    assert out[1]["reported"] == [(), ()]  # only the export rank hears back
    # The receiver holds the weights of step 4 exactly, not those of step 5.
    for name, ref in rank0["exported"].items():
        assert torch.equal(rank0["state"][name], ref), name
    assert any(not torch.equal(rank0["final"][n], ref) for n, ref in rank0["exported"].items())
