"""Set up one rank of a uniform-TP or a nonuniform-TP job (tests, demo, benchmarks)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class JobRank:
    """This rank's place in the job: its data-parallel replica and whether that
    replica runs at reduced TP. ``ntp_config`` is None for a uniform job."""

    ntp_config: object
    replica: int
    replicas: int
    degraded: bool


def init_job(ntp_kwargs: dict | None, tp: int = 1, pp: int = 1) -> JobRank | None:
    """Initialise Megatron's model-parallel state for a uniform TP=``tp`` x PP=``pp`` job
    (``ntp_kwargs is None``) or an NTP job from ``NonuniformTPConfig(**ntp_kwargs)`` (its
    ``pipeline_model_parallel_size`` stages). Returns None on a rank that left (NTP simulate mode)."""
    from megatron.core import parallel_state as ps

    from megatron_ext.nonuniform_tp import NonuniformTPConfig, initialize_nonuniform_tp_process_groups

    if ntp_kwargs is None:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        return JobRank(None, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), False)
    config = NonuniformTPConfig(**ntp_kwargs)
    # TP=1 and the job's stages; the NTP groups replace TP/DP
    ps.initialize_model_parallel(pipeline_model_parallel_size=config.pipeline_model_parallel_size)
    groups = initialize_nonuniform_tp_process_groups(config)
    if not groups.is_active:
        return None
    return JobRank(config, groups.role.replica, groups.layout.num_replicas, groups.role.degraded)


def train_pipelined(ddp, optimizer, spec, steps: int, job: JobRank, global_batch: int = 4) -> None:
    """``steps`` optimizer steps of a tiny model (``tiny_gpt``'s synthetic data for ``spec``) through
    Megatron's forward-backward function (1F1B with pipeline stages): this replica's equal share of each
    global batch as one micro-batch, the gradients synced by ``megatron_ext.nonuniform_tp.finalize_model_grads``
    (set on the model's config, as Megatron-LM's training loop sets it)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.nonuniform_tp import finalize_model_grads
    from megatron_ext.testing import tiny_gpt

    config = ddp.config
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads  # without it the schedule syncs no gradient
    seq = spec.seq_length
    device = tiny_gpt.rank_device()
    position_ids = torch.arange(seq, device=device).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)

    def forward_step(data, model):
        tokens, labels = next(data)
        out = model(tokens, position_ids.expand_as(tokens), mask, labels=labels)
        return out, lambda o: (o.float().mean(), {})

    share = global_batch // job.replicas
    mine = slice(job.replica * share, (job.replica + 1) * share)
    for step in range(steps):
        tokens, labels = tiny_gpt.global_batch(spec, step, global_batch)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([(tokens[mine].to(device), labels[mine].to(device))]),
            model=[ddp],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=share,
        )
        assert optimizer.step()[0], f"optimizer step {step} was skipped"
