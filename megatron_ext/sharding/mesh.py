"""A Megatron job's parallel mesh as this process sees it: sizes, its ranks and groups.

Read once from ``megatron.core.parallel_state`` (a single-rank mesh where model
parallelism is not initialized), so that the export hook and the trainer's
layout (:meth:`MegatronMesh.layout`) never re-derive the topology by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .geometry import Layout
from .megatron import megatron_layout
from .spec import TensorSpec

__all__ = ["MegatronMesh", "megatron_layout_from_groups"]


@dataclasses.dataclass(frozen=True)
class MegatronMesh:
    """Sizes (``tp``, ``pp``, ``dp`` without context parallelism, ``cp``, ``ep``,
    ``etp``), this rank's coordinates (``dp_rank`` counts CP ranks too, as
    Megatron's gradient groups do; ``edp_rank`` is its expert-data-parallel rank)
    and its groups (None on a single-rank mesh)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    tp_group: Any = None
    pp_group: Any = None
    ep_group: Any = None
    etp_ep_group: Any = None  # expert TP x EP: every shard of every expert of the stage

    @classmethod
    def current(cls) -> MegatronMesh:
        """This process's mesh from ``parallel_state`` (single rank if it is not initialized)."""
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            return cls()
        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            edp_rank=ps.get_expert_data_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
            etp_ep_group=ps.get_expert_tensor_and_model_parallel_group(),
        )

    def layout(self, specs: list[TensorSpec], *, ranks: Sequence[int] | None = None) -> Layout:
        """The trainer's :func:`~.megatron.megatron_layout` at this mesh's sizes. ``ranks``: the
        job's ranks in the group that moves the bytes (default: its global ranks ``0..world-1``).
        Checks, without communication, that this rank's TP and PP groups are where Megatron's
        default order (``tp-cp-ep-dp-pp``) puts them; raises ValueError if not (context
        parallelism > 1 or another ``order`` is not described)."""
        import torch.distributed as dist

        if self.tp_group is None:
            raise ValueError("the trainer's layout needs parallel_state.initialize_model_parallel() first")
        if self.cp != 1:
            raise ValueError("context parallelism > 1 is not described by megatron_layout; build the layout by hand")
        tp, pp, dp = self.tp, self.pp, self.dp
        world, me = dist.get_world_size(), dist.get_rank()
        if tp * pp * dp != world:
            raise ValueError(f"TP={tp} x PP={pp} x DP={dp} != world size {world}")
        for kind, group, expected in (
            ("tensor", self.tp_group, [me // tp * tp + t for t in range(tp)]),
            ("pipeline", self.pp_group, [me % (tp * dp) + s * tp * dp for s in range(pp)]),
        ):
            actual = dist.get_process_group_ranks(group)
            if sorted(actual) != expected:
                raise ValueError(
                    f"rank {me}: its {kind}-parallel group is {actual}, Megatron's default order "
                    f"tp-cp-ep-dp-pp puts it at {expected}; build the layout by hand for another order"
                )
        ranks = range(world) if ranks is None else ranks
        return megatron_layout(specs, tp=tp, pp=pp, dp=dp, ep=self.ep, etp=self.etp, ranks=ranks)


def megatron_layout_from_groups(specs: list[TensorSpec], *, ranks: Sequence[int] | None = None) -> Layout:
    """The trainer's layout read from this process's live Megatron groups: TP, PP, DP, EP and
    expert-TP sizes (:meth:`MegatronMesh.layout`, which says what it checks), so nobody
    types the trainer's topology by hand. ``ranks``: the job's ranks in the group that moves
    the bytes (default: its global ranks ``0..world-1``)."""
    return MegatronMesh.current().layout(specs, ranks=ranks)
