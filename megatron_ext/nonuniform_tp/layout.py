"""Rank layout of an NTP job: which global ranks form which TP and DP groups.

Replica ``d`` has TP slots ``0..tp_base-1``. A degraded replica's active slots,
in slot order, are its TP ranks ``0..tp_reduced-1``; a healthy replica's slot
is its TP rank. TP rank ``i < tp_reduced`` is a *core* rank, the others (only
in healthy replicas) are *spares*.

Data-parallel groups: for each core TP rank ``i``, one group of the TP-rank-``i``
process of every replica (the gradients it reduces are laid out as a degraded
replica's rank ``i`` holds them). For each spare TP rank ``j``, one group of
the healthy replicas' rank ``j`` (it never carries training state).

Global ranks: ``packed`` numbers the active slots replica by replica, skipping
the failed ones (world = healthy GPUs); ``simulate`` gives slot ``s`` of replica
``d`` rank ``d * tp_base + s`` and the failed slots are processes that leave.
"""

from __future__ import annotations

import dataclasses

__all__ = ["NTPLayout", "RankRole"]


@dataclasses.dataclass(frozen=True)
class RankRole:
    """Where one global rank sits in the NTP layout."""

    replica: int
    slot: int
    tp_rank: int
    tp_size: int
    degraded: bool
    tp_size_reduced: int

    @property
    def spare(self) -> bool:
        """A healthy replica's TP rank with no counterpart in degraded replicas."""
        return not self.degraded and self.tp_rank >= self.tp_size_reduced


@dataclasses.dataclass(frozen=True)
class NTPLayout:
    tp_base: int
    tp_reduced: int
    num_replicas: int
    mode: str
    # rank_of[d][s]: global rank of slot s in replica d; None for a failed slot
    # in packed mode. In simulate mode failed slots keep a (non-active) rank.
    rank_of: tuple[tuple[int | None, ...], ...]
    failed: dict

    @classmethod
    def from_config(cls, config, world_size: int) -> "NTPLayout":
        b, failed = config.tp_base, config.non_active_ranks_per_dp
        n_failed = sum(len(s) for s in failed.values())
        if config.launch_mode == "simulate":
            if world_size % b:
                raise ValueError(
                    f"launch_mode='simulate' needs a process for every slot: world size {world_size} "
                    f"must be a multiple of tp_base={b}"
                )
            replicas = world_size // b
        else:
            if (world_size + n_failed) % b:
                raise ValueError(
                    f"launch_mode='packed': world size {world_size} + {n_failed} failed GPU(s) is not a "
                    f"multiple of tp_base={b}; launch exactly the healthy GPUs (non_active_ranks_per_dp="
                    f"{failed})"
                )
            replicas = (world_size + n_failed) // b
        if config.data_parallel_size is not None and config.data_parallel_size != replicas:
            expected = config.data_parallel_size * b - (0 if config.launch_mode == "simulate" else n_failed)
            raise ValueError(
                f"NonuniformTPConfig.data_parallel_size={config.data_parallel_size} does not match world "
                f"size {world_size} (launch_mode={config.launch_mode!r} expects {expected} processes)"
            )
        bad = [d for d in failed if d >= replicas]
        if bad:
            raise ValueError(
                f"NonuniformTPConfig.non_active_ranks_per_dp names replica(s) {bad} but the job has "
                f"{replicas} replicas (allowed: 0..{replicas - 1})"
            )
        rank_of, nxt = [], 0
        for d in range(replicas):
            row = []
            for s in range(b):
                if config.launch_mode == "simulate":
                    row.append(d * b + s)
                elif s in failed.get(d, ()):
                    row.append(None)
                else:
                    row.append(nxt)
                    nxt += 1
            rank_of.append(tuple(row))
        return cls(b, config.tp_reduced, replicas, config.launch_mode, tuple(rank_of), dict(failed))

    # ---- groups -------------------------------------------------------------
    def is_degraded(self, replica: int) -> bool:
        return replica in self.failed

    def active_slots(self, replica: int) -> list[int]:
        return [s for s in range(self.tp_base) if s not in self.failed.get(replica, ())]

    def tp_group_ranks(self, replica: int) -> list[int]:
        """Global ranks of a replica's TP group, in TP-rank order."""
        return [self.rank_of[replica][s] for s in self.active_slots(replica)]

    def dp_group_ranks(self, tp_rank: int) -> list[int]:
        """Global ranks of the DP group of TP rank ``tp_rank`` (core or spare)."""
        if tp_rank < self.tp_reduced:
            return [self.tp_group_ranks(d)[tp_rank] for d in range(self.num_replicas)]
        return [self.tp_group_ranks(d)[tp_rank] for d in range(self.num_replicas) if not self.is_degraded(d)]

    def all_tp_groups(self) -> list[list[int]]:
        return [self.tp_group_ranks(d) for d in range(self.num_replicas)]

    def all_dp_groups(self) -> list[list[int]]:
        """Core groups first, then spare groups (empty ones skipped)."""
        groups = [self.dp_group_ranks(i) for i in range(self.tp_base)]
        return [g for g in groups if g]

    @property
    def world_size(self) -> int:
        return sum(r is not None for row in self.rank_of for r in row)

    @property
    def active_ranks(self) -> list[int]:
        return sorted(r for g in self.all_tp_groups() for r in g)

    def role(self, rank: int) -> RankRole | None:
        """This rank's place, or ``None`` for a non-active rank (simulate mode)."""
        for d in range(self.num_replicas):
            ranks = self.tp_group_ranks(d)
            if rank in ranks:
                slot = self.active_slots(d)[ranks.index(rank)]
                return RankRole(
                    replica=d,
                    slot=slot,
                    tp_rank=ranks.index(rank),
                    tp_size=len(ranks),
                    degraded=self.is_degraded(d),
                    tp_size_reduced=self.tp_reduced,
                )
        return None
