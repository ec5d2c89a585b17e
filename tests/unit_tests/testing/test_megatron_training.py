"""A real megatron-core GPTModel trains through the test harness, on CPU ranks
(gloo) and, where GPUs are present, on NCCL: TP parity with a single rank, DDP
gradient averaging, and the Megatron optimizer (plain and distributed) matching
a single-rank run step for step."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks

SPEC = tiny_gpt.TinyGPTSpec()
RTOL = 1e-5
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(2))]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _gather_tp(param, tensor):
    """The full tensor of a TP-sharded parameter (or the tensor itself)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def _tp_loss_and_grads(tp):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    dev = tiny_gpt.rank_device()
    model = tiny_gpt.build_model(SPEC, tiny_gpt.transformer_config(SPEC, tp=tp), device=dev)
    tokens, labels = tiny_gpt.global_batch(SPEC, step=0, num_samples=SPEC.micro_batch_size)
    loss = tiny_gpt.forward_loss(model, tokens.to(dev), labels.to(dev))
    loss.backward()
    grads = {n: _gather_tp(p, p.grad).cpu() for n, p in model.named_parameters()}
    return loss.item(), grads, _rng_warnings()


def _rng_warnings() -> list[str]:
    """What megatron-core logs for a dropout inside the model-parallel RNG tracker's fork (each
    dropout layer does this). On CPU the "CUDA" RNG is the CPU generator (cpu_compat), so the fork
    moves the CPU state by design; megatron-core's warning about that must not reach the log."""
    import logging

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    handler = Keep()
    logger.addHandler(handler)
    try:
        with get_cuda_rng_tracker().fork():
            torch.nn.functional.dropout(torch.ones(64, device=tiny_gpt.rank_device()), 0.5)
    finally:
        logger.removeHandler(handler)
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_loss_and_grads_match_single_rank(backend):
    ((ref_loss, ref_grads, warned),) = run_on_ranks(_tp_loss_and_grads, 1, args=(1,), backend=backend)
    out = run_on_ranks(_tp_loss_and_grads, 2, args=(2,), backend=backend)
    assert warned == [] and all(o[2] == [] for o in out), "megatron-core's RNG warning reached the log"
    for loss, grads, _ in out:
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            assert grads[name].shape == ref.shape, name
            assert ref.abs().max() > 0, f"{name}: zero reference grad makes the check vacuous"
            assert _rel_err(grads[name], ref) <= RTOL, name


def _ddp_main_grads_vs_local_average():
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ps.initialize_model_parallel()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cfg = tiny_gpt.transformer_config(SPEC)
    dev = tiny_gpt.rank_device()
    tokens, labels = tiny_gpt.global_batch(SPEC, step=0, num_samples=SPEC.micro_batch_size * dp)
    mine = slice(dp_rank * SPEC.micro_batch_size, (dp_rank + 1) * SPEC.micro_batch_size)
    tokens, labels = tokens[mine].to(dev), labels[mine].to(dev)

    # Independent per-rank gradient: a plain (unwrapped) copy of the same model.
    plain = tiny_gpt.build_model(SPEC, cfg, device=dev)
    tiny_gpt.forward_loss(plain, tokens, labels).backward()
    local = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}

    ddp = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=tiny_gpt.build_model(SPEC, cfg, device=dev),
    )
    ddp.zero_grad_buffer()
    tiny_gpt.forward_loss(ddp, tokens, labels).backward()
    ddp.finish_grad_sync()
    reduced = {n.removeprefix("module."): p.main_grad.detach().cpu() for n, p in ddp.named_parameters()}

    gathered = {}
    for name, g in local.items():
        parts = [torch.empty_like(g) for _ in range(dp)]
        dist.all_gather(parts, g, group=ps.get_data_parallel_group())
        gathered[name] = [t.cpu() for t in parts]
    return {n: g.cpu() for n, g in local.items()}, reduced, gathered


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_dp2_main_grad_is_the_average_of_rank_grads(backend):
    out = run_on_ranks(_ddp_main_grads_vs_local_average, 2, backend=backend)
    (local0, _, gathered), (local1, _, _) = out
    # The two ranks saw different data, so their local grads differ.
    assert any(not torch.equal(local0[n], local1[n]) for n in local0)
    for _, reduced, gathered in out:
        assert reduced.keys() == gathered.keys()
        for name, parts in gathered.items():
            expected = torch.stack(parts).mean(dim=0)
            assert _rel_err(reduced[name], expected) <= RTOL, name


def _train_with_megatron_optimizer(tp, steps, distributed_optimizer, overlap):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cfg = tiny_gpt.transformer_config(SPEC, tp=tp)
    dev = tiny_gpt.rank_device()
    ddp = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=distributed_optimizer,
            bucket_size=4096 if overlap else None,
        ),
        module=tiny_gpt.build_model(SPEC, cfg, device=dev),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=3e-3, weight_decay=0.01, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer
        ),
        [ddp],
    )
    n_local = 4 // dp
    losses = []
    for step in range(steps):
        tokens, labels = tiny_gpt.global_batch(SPEC, step=step, num_samples=4)
        mine = slice(dp_rank * n_local, (dp_rank + 1) * n_local)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = tiny_gpt.forward_loss(ddp, tokens[mine].to(dev), labels[mine].to(dev))
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok, f"optimizer step {step} was skipped"
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=ps.get_data_parallel_group())
        losses.append((mean / dp).item())
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "tp,distributed_optimizer,overlap",
    [(1, True, True), (2, False, False)],
    ids=["dp2-distopt-overlap", "tp2-plainopt"],
)
def test_megatron_optimizer_matches_single_rank(tp, distributed_optimizer, overlap, backend):
    steps = 6
    (ref,) = run_on_ranks(_train_with_megatron_optimizer, 1, args=(1, steps, False, False), backend=backend)
    out = run_on_ranks(
        _train_with_megatron_optimizer, 2, args=(tp, steps, distributed_optimizer, overlap), backend=backend
    )
    assert ref[-1] < ref[0], f"baseline did not learn: {ref}"
    for losses in out:
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) <= RTOL * abs(b), f"step {step}: {a} vs {b}"
