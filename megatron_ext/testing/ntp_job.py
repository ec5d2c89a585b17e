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
