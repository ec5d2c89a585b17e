"""Demo phase for nonuniform TP: a GPU of replica 0 "fails", the job relaunches
on the surviving GPUs only (packed layout) and keeps training, replica 0 at a
reduced TP degree as the satellite of a healthy partner replica (its gradients
join the partner's buckets; the partner steps the optimizer and sends the
weights back). Rank 0 prints each rank's role and bytes at the end: the
degraded replica holds no optimizer state.

    rows = run_ntp_phase(tp_base=2, world_size=4, steps=20)    # called by examples/demo.py

``run_ntp_phase`` returns ``[(step, loss, seconds), ...]`` like the demo's
uniform phase: ``loss`` is the global-batch loss (mean over replicas), so the
two curves are comparable step for step.
"""

from __future__ import annotations

import time


from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks


def _ntp_rank(ntp_kwargs, spec, steps, global_batch, lr, phase):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.nonuniform_tp import (
        NonuniformTPConfig,
        NonuniformTPDistributedDataParallel,
        initialize_nonuniform_tp_process_groups,
    )

    ps.initialize_model_parallel()  # TP=1 here; the NTP groups replace TP/DP below
    ntp_config = NonuniformTPConfig(**ntp_kwargs)
    groups = initialize_nonuniform_tp_process_groups(ntp_config)
    role, replicas = groups.role, groups.layout.num_replicas
    tp = ps.get_tensor_model_parallel_world_size()
    device = tiny_gpt.rank_device()
    tconf = tiny_gpt.transformer_config(spec, tp=tp)
    model = NonuniformTPDistributedDataParallel(
        tconf,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        tiny_gpt.build_model(spec, tconf, device=device),
        ntp_config=ntp_config,
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=1.0), [model])
    if dist.get_rank() == 0:
        pairs = ", ".join(f"replica {d} -> partner {p}" for d, p in groups.layout.partners.items())
        print(
            f"[{phase}] {dist.get_world_size()} ranks; TP groups {groups.layout.all_tp_groups()}, degraded replica(s) "
            f"{groups.layout.degraded_replicas} at TP={groups.layout.tp_reduced} ({pairs or 'no partners'})",
            flush=True,
        )
    per_replica = global_batch // replicas
    mine = slice(role.replica * per_replica, (role.replica + 1) * per_replica)
    rows = []
    for step in range(steps):
        start = time.perf_counter()
        tokens, labels = tiny_gpt.global_batch(spec, step, global_batch)
        loss = tiny_gpt.train_step(model, opt, tokens[mine].to(device), labels[mine].to(device))
        # Mean over replicas: every rank adds loss / (its TP size * replicas).
        mean = loss / (role.tp_size * replicas)
        dist.all_reduce(mean)
        rows.append((step, mean.item(), time.perf_counter() - start))
        if dist.get_rank() == 0:
            print(f"[{phase}] step {step + 1:3d}/{steps}  loss {rows[-1][1]:.4f}", flush=True)
    # Where the bytes are, per rank (exact tensor sizes, after Adam allocated its state in the first step).
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, model.memory_report(opt))
    if dist.get_rank() == 0:
        kib = lambda n: f"{(n or 0) / 1024:7.1f}"  # noqa: E731
        print(f"[{phase}] KiB per rank:  role       params    grads  staging  optimizer", flush=True)
        for rank, r in enumerate(reports):
            print(
                f"[{phase}]   rank {rank}   {r.role:9s} {kib(r.params)} {kib(r.grads)} {kib(r.staging)} "
                f"{kib(r.optimizer)}",
                flush=True,
            )
    return rows


def ntp_config_kwargs(tp_base: int, world_size: int, failed_slots: str, spec: tiny_gpt.TinyGPTSpec) -> dict:
    """The NonuniformTPConfig of a ``world_size``-GPU TP=``tp_base`` job that lost ``failed_slots``,
    checked against its layout (ValueError naming what is wrong, e.g. more degraded replicas than healthy
    ones: each needs its own partner)."""
    from megatron_ext.nonuniform_tp import (
        NonuniformTPConfig,
        compute_uniform_tp_spares_with_parity,
        parse_failed_slots,
    )

    sizes = {
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups,
        "ffn_hidden_size": spec.ffn_hidden_size,
    }
    spares, failed = compute_uniform_tp_spares_with_parity(parse_failed_slots(failed_slots), tp_base, divides=sizes)
    kwargs = dict(
        tp_base=tp_base, tp_spares=spares, non_active_ranks_per_dp=failed, data_parallel_size=world_size // tp_base
    )
    NonuniformTPConfig(**kwargs).layout(world_size - sum(len(s) for s in failed.values()))
    return kwargs


def run_ntp_phase(
    *,
    tp_base: int = 2,
    world_size: int = 4,
    failed_slots: str = "0:1",
    steps: int = 20,
    global_batch: int = 8,
    lr: float = 3e-3,
    backend: str = "gloo",
    spec: tiny_gpt.TinyGPTSpec | None = None,
    phase: str = "ntp",
):
    """Relaunch a ``world_size``-GPU TP=``tp_base`` job without the GPUs in
    ``failed_slots`` ("REPLICA:SLOT[,SLOT];...") and train ``steps`` steps.
    Returns ``[(step, loss, seconds)]`` (rank 0's view)."""
    spec = spec or tiny_gpt.TinyGPTSpec()
    ntp_kwargs = ntp_config_kwargs(tp_base, world_size, failed_slots, spec)
    failed = ntp_kwargs["non_active_ranks_per_dp"]
    packed_world = world_size - sum(len(s) for s in failed.values())
    print(f"[{phase}] GPU(s) {failed} fail; relaunching on the {packed_world} healthy GPUs", flush=True)
    return run_on_ranks(
        _ntp_rank, packed_world, args=(ntp_kwargs, spec, steps, global_batch, lr, phase), backend=backend, timeout=600
    )[0]
