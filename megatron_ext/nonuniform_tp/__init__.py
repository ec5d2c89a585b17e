"""Nonuniform tensor parallelism (NTP): data-parallel replicas that lost GPUs
keep training at a reduced TP degree while healthy replicas keep ``tp_base``.
Each degraded replica is a satellite of one healthy partner replica, which adds
its gradients and sends it the updated parameters; the other healthy replicas
run Megatron's DDP unchanged.

Usage (every rank)::

    parallel_state.initialize_model_parallel()          # TP=PP=1
    groups = initialize_nonuniform_tp_process_groups(ntp_config)
    if groups.is_active:                                 # False only for leavers in simulate mode
        model = build_model(...)                         # sees its replica's TP degree
        ddp = NonuniformTPDistributedDataParallel(config, ddp_config, model, ntp_config=ntp_config)

Balanced batch shares (``--ntp-balance tp``)::

    shares = ntp_config.batch_shares(global_batch_size, micro_batch_size)
    ddp = NonuniformTPDistributedDataParallel(..., ntp_config=ntp_config, batch_shares=shares)
    sampler = BalancedPretrainingSampler(len(dataset), consumed_samples, shares)   # DataLoader batch_sampler
    forward_backward_func(..., num_microbatches=shares.num_microbatches())

``--ntp-balance measured``: ``balance = MeasuredBalance(ntp_config, global_batch_size, micro_batch_size)``
starts with those shares and, after the timed warm-up steps, ``balance.step_finished()`` returns
the shares by measured throughput (then ``ddp.set_batch_shares(new)``, ``sampler.switch(new, consumed)``).

Distributed checkpoints (megatron-core ``dist_checkpointing``, any TP layout resumes them)::

    model_sd = model_sharded_state_dict(ddp)            # None on a degraded replica (healthy ones: uniform tp_base)

See docs/nonuniform_tp.md.
"""

from .balance import (
    BalancedPretrainingSampler,
    BatchShares,
    MeasuredBalance,
    balanced_batch_shares,
    equal_batch_shares,
    reduce_loss_over_replicas,
    shrunk_batch_shares,
)
from .config import (
    NonuniformTPConfig,
    add_nonuniform_tp_args,
    compute_uniform_tp_spares_with_parity,
    format_failed_slots,
    parse_failed_slots,
)
from .layout import NTPLayout, RankRole
from .process_groups import (
    NTPProcessGroups,
    destroy_nonuniform_tp_process_groups,
    get_ntp_process_groups,
    initialize_nonuniform_tp_process_groups,
)


def __getattr__(name):
    # The DDP subclass imports megatron-core's DDP; load it on first use.
    if name in (
        "NonuniformTPDistributedDataParallel",
        "PartnerBucketGroup",
        "DDPMemoryReport",
        "ddp_memory_report",
    ):
        from . import ddp

        return getattr(ddp, name)
    if name == "finalize_model_grads":
        from .finalize import finalize_model_grads

        return finalize_model_grads
    if name in (
        "ntp_to_uniform",
        "uniform_to_ntp",
        "merge_tp_shards",
        "split_tp_full",
        "model_sharded_state_dict",
        "share_common_state",
        "shard_specs",
    ):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)


__all__ = [
    "BalancedPretrainingSampler",
    "BatchShares",
    "DDPMemoryReport",
    "MeasuredBalance",
    "NTPLayout",
    "NTPProcessGroups",
    "NonuniformTPConfig",
    "NonuniformTPDistributedDataParallel",
    "PartnerBucketGroup",
    "RankRole",
    "add_nonuniform_tp_args",
    "balanced_batch_shares",
    "compute_uniform_tp_spares_with_parity",
    "ddp_memory_report",
    "destroy_nonuniform_tp_process_groups",
    "equal_batch_shares",
    "finalize_model_grads",
    "format_failed_slots",
    "get_ntp_process_groups",
    "initialize_nonuniform_tp_process_groups",
    "merge_tp_shards",
    "model_sharded_state_dict",
    "ntp_to_uniform",
    "parse_failed_slots",
    "reduce_loss_over_replicas",
    "share_common_state",
    "shard_specs",
    "shrunk_batch_shares",
    "split_tp_full",
    "uniform_to_ntp",
]
