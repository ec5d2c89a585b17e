"""Build the TP and DP process groups of an NTP job and install them where
megatron-core 0.19 reads them.

Megatron's ``initialize_model_parallel`` needs ``world % tp == 0``, which a
packed NTP job (healthy GPUs only) does not satisfy. So the job first calls
``parallel_state.initialize_model_parallel()`` with TP=1 and its pipeline size
(valid for any world size that splits into the stages; with the stage-major rank
order of :mod:`.layout` Megatron's pipeline and embedding groups, rank ``i`` of every
stage, are the NTP job's) and then :func:`initialize_nonuniform_tp_process_groups`,
which checks those pipeline groups, creates the NTP TP, model-parallel (TP x PP)
and DP groups (and the gloo, partial-DP, expert and optimizer-instance variants
Megatron's DDP and optimizer read) and sets the corresponding ``parallel_state``
globals. Model layers, DDP and the optimizer in 0.19 read
those globals when no ``pg_collection`` is passed; the returned state also
offers :meth:`NTPProcessGroups.pg_collection` for callers that pass groups
explicitly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from .layout import NTPLayout, RankRole

__all__ = ["NTPProcessGroups", "get_ntp_process_groups", "initialize_nonuniform_tp_process_groups"]

_STATE: "NTPProcessGroups | None" = None


@dataclasses.dataclass
class NTPProcessGroups:
    """This rank's NTP groups. ``role is None`` on a non-active rank (simulate mode):
    it must not train; it only takes part in ``destroy_process_group``."""

    config: Any  # the NonuniformTPConfig they were built from (not imported: config.py reads these groups)
    layout: NTPLayout
    role: RankRole | None
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    dp_group_gloo: dist.ProcessGroup | None
    optimizer_group: dist.ProcessGroup | None  # healthy ranks together; a degraded replica alone
    pair_group: dist.ProcessGroup | None = None  # a degraded replica and its partner (this stage); None elsewhere
    model_parallel_group: dist.ProcessGroup | None = None  # this replica's ranks, every stage (TP x PP)

    @property
    def is_active(self) -> bool:
        return self.role is not None

    @property
    def ntp_active(self) -> bool:
        """True when replicas run at different TP degrees (else NTP is a no-op)."""
        return self.layout.nonuniform

    def pg_collection(self):
        """A megatron ``ProcessGroupCollection`` with the NTP groups."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection.use_mpu_process_groups()


def get_ntp_process_groups() -> NTPProcessGroups | None:
    """The groups installed by :func:`initialize_nonuniform_tp_process_groups`."""
    return _STATE


def _new_groups(ranks_list, backend=None):
    """Create every group on every rank (same order everywhere); return the
    one this rank is in (or None)."""
    me, mine = dist.get_rank(), None
    for ranks in ranks_list:
        group = dist.new_group(ranks, backend=backend) if backend else dist.new_group(ranks)
        if me in ranks:
            mine = group
    return mine


def initialize_nonuniform_tp_process_groups(config) -> NTPProcessGroups:
    """Create the NTP groups of ``config`` (a :class:`~.config.NonuniformTPConfig`) and install them into
    ``megatron.core.parallel_state``.

    Call on every rank after ``parallel_state.initialize_model_parallel()`` with
    TP=CP=EP=1 and ``pipeline_model_parallel_size=config.pipeline_model_parallel_size``
    (and the virtual pipeline size, if any). In ``simulate`` mode every slot has a process, and with
    ``policy="drop"`` the degraded replicas' processes take no part: those
    processes leave the default process group, which is rebuilt over the active
    ranks (renumbered as in the packed layout, Megatron's groups re-initialised);
    they get a state with ``is_active == False`` and must skip training --
    nothing here exits the process.
    """
    global _STATE
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "call megatron.core.parallel_state.initialize_model_parallel() (TP=1, the job's pipeline size) before "
            "initialize_nonuniform_tp_process_groups()"
        )
    pp = config.pipeline_model_parallel_size
    if ps.get_pipeline_model_parallel_world_size() != pp:
        raise ValueError(
            f"initialize_model_parallel() was called with pipeline_model_parallel_size="
            f"{ps.get_pipeline_model_parallel_world_size()} but NonuniformTPConfig.pipeline_model_parallel_size={pp}: "
            "pass the same --pipeline-model-parallel-size to both"
        )
    if ps.get_context_parallel_world_size() != 1:
        raise ValueError(
            "nonuniform TP supports context_parallel_size=1 only (--context-parallel-size): a context-parallel rank "
            "holds part of every sequence at its own TP degree, and a degraded replica would need a partner per "
            "sequence part; initialize_model_parallel() with context_parallel_size=1"
        )
    if ps.get_tensor_model_parallel_world_size() != 1:
        raise ValueError(
            "initialize_model_parallel() must be called with tensor_model_parallel_size=1; the NTP "
            f"TP groups (tp_base={config.tp_base}) are created by initialize_nonuniform_tp_process_groups"
        )
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    launched = config.layout(dist.get_world_size())
    if launched.leaving:  # simulate mode's failed slots, the replicas --ntp-policy drop drops
        if not _rejoin_active_ranks(launched.active_ranks):
            _STATE = NTPProcessGroups(config, launched, None, None, None, None, None)
            return _STATE
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    world, me = dist.get_world_size(), dist.get_rank()
    layout = launched.after_leaving()
    assert layout.world_size == world, (layout, world)
    role = layout.role(me)
    pipeline = next(g for g in layout.all_pipeline_groups() if me in g)
    if list(ps._PIPELINE_GLOBAL_RANKS) != pipeline:
        raise RuntimeError(
            f"rank {me}: Megatron's pipeline group {ps._PIPELINE_GLOBAL_RANKS} is not the NTP layout's {pipeline}; "
            "initialize_model_parallel() with its default order (tp-cp-ep-dp-pp) and TP=1"
        )

    # Every rank creates every group, in the same order.
    tp_group = _new_groups(layout.all_tp_groups())
    dp_lists = layout.all_dp_groups()
    dp_group = _new_groups(dp_lists)
    dp_group_gloo = _new_groups(dp_lists, backend="gloo")
    pair_group = _new_groups(layout.all_pair_groups())
    optimizer_lists = layout.optimizer_groups()
    optimizer_group = _new_groups(optimizer_lists)
    # with one stage a replica's model-parallel group is its TP group, and the per-stage optimizer
    # group (Megatron's TP x DP) the optimizer group: no second communicator for the same ranks
    model_parallel_group = tp_group if pp == 1 else _new_groups(layout.all_model_parallel_groups())
    stage_optimizer_group = optimizer_group if pp == 1 else _new_groups(layout.stage_optimizer_groups())

    _STATE = NTPProcessGroups(
        config, layout, role, tp_group, dp_group, dp_group_gloo, optimizer_group, pair_group, model_parallel_group
    )
    if role is None:
        return _STATE

    tp_ranks = layout.tp_group_ranks(role.replica, role.stage)
    dp_ranks = next(g for g in dp_lists if me in g)
    for name in (
        "_TENSOR_MODEL_PARALLEL_GROUP",
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
        "_EXPERT_TENSOR_PARALLEL_GROUP",
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
    ):
        setattr(ps, name, tp_group)
    for name in (
        "_MODEL_PARALLEL_GROUP",
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
    ):
        setattr(ps, name, model_parallel_group)
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = tp_ranks
    ps._MODEL_PARALLEL_GLOBAL_RANKS = layout.replica_ranks(role.replica)
    for name in (
        "_DATA_PARALLEL_GROUP",
        "_DATA_PARALLEL_GROUP_WITH_CP",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
        "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
        "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
        "_EXPERT_DATA_PARALLEL_GROUP",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    ):
        setattr(ps, name, dp_group)
    for name in (
        "_DATA_PARALLEL_GROUP_GLOO",
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    ):
        setattr(ps, name, dp_group_gloo)
    for name in ("_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP"):
        setattr(ps, name, dp_ranks)
    for name in ("_TENSOR_AND_DATA_PARALLEL_GROUP", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP"):
        setattr(ps, name, stage_optimizer_group)
    ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = optimizer_group
    # Data loaders ask get_data_parallel_rank()/world_size() which share of the
    # global batch to read: on every rank (spares included) that is its replica.
    ps._MPU_DATA_PARALLEL_RANK = role.replica
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = layout.num_replicas
    return _STATE


def _rejoin_active_ranks(active: list[int]) -> bool:
    """The processes not in ``active`` leave and the others form a new default process group,
    numbered in the order of ``active`` (so every world-wide collective Megatron issues later sees
    only active ranks). Returns whether this rank is active."""
    import os
    import socket

    import torch
    from megatron.core import parallel_state as ps

    me = dist.get_rank()
    backend = dist.get_backend()
    # The first active rank hosts the new rendezvous store on a free port.
    info = [None]
    if me == active[0]:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if me == 0 else socket.gethostname()
        store = dist.TCPStore("0.0.0.0", 0, len(active), is_master=True, wait_for_workers=False)
        info = [(host, store.port)]
    dist.broadcast_object_list(info, src=active[0])
    host, port = info[0]
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    if me not in active:
        return False
    if me != active[0]:
        store = dist.TCPStore(host, port, len(active), is_master=False)
    kw = {}
    if backend == "nccl":
        kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, store=store, rank=active.index(me), world_size=len(active), **kw)
    _rejoin_active_ranks.store = store  # keep the store (and its server) alive with the group
    return True


def destroy_nonuniform_tp_process_groups() -> None:
    """Forget the installed NTP state and the data-parallel rank/size overrides
    (``parallel_state.destroy_model_parallel`` resets the groups)."""
    global _STATE
    from megatron.core import parallel_state as ps

    ps._MPU_DATA_PARALLEL_RANK = None
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = None
    _STATE = None
