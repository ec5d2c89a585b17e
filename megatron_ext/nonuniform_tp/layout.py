"""Rank layout of an NTP job: which global ranks form which TP, DP and partner groups.

Replica ``d`` has TP slots ``0..tp_base-1``. A degraded replica's active slots,
in slot order, are its TP ranks ``0..tp_reduced-1``; a healthy replica's slot
is its TP rank.

Healthy replicas form a uniform ``tp_base`` job among themselves: the DP group
of TP rank ``j`` holds rank ``j`` of every healthy replica. Each degraded
replica is a *satellite* of one healthy *partner* replica (the ``k``-th
degraded replica, in index order, of the ``k``-th healthy one): its gradients
go to the partner's ranks before the partner's DP collective, and the updated
parameters come back from them. A degraded replica takes part in no DP
collective; its DP group is the rank alone. The healthy replicas that are
nobody's partner are *bystanders*: a uniform job's ranks.

When every replica is degraded (or none is), the job is uniform: all replicas
at one degree, DP groups over all of them.

Global ranks: ``packed`` numbers the active slots replica by replica, skipping
the failed ones (world = healthy GPUs); ``simulate`` gives slot ``s`` of replica
``d`` rank ``d * tp_base + s`` and the failed slots are processes that leave.
"""

from __future__ import annotations

import dataclasses

__all__ = ["NTPLayout", "RankRole", "pair_up"]


def pair_up(degraded, healthy) -> dict[int, int]:
    """Degraded replica -> its healthy partner: the ``k``-th degraded replica (in replica order) with the
    ``k``-th healthy one; degraded replicas beyond the healthy ones get none."""
    return dict(zip(sorted(degraded), sorted(healthy)))


@dataclasses.dataclass(frozen=True)
class RankRole:
    """Where one global rank sits in the NTP layout. ``partner``: on a degraded
    replica the healthy replica it is the satellite of; on a healthy replica the
    degraded replica it is the partner of; ``None`` on bystanders and in uniform jobs."""

    replica: int
    slot: int
    tp_rank: int
    tp_size: int
    degraded: bool
    tp_size_reduced: int
    partner: int | None = None

    @property
    def kind(self) -> str:
        """``"uniform"`` (no replica runs at another degree), ``"bystander"``, ``"partner"`` or ``"degraded"``."""
        if self.degraded:
            return "degraded" if self.partner is not None else "uniform"
        if self.partner is not None:
            return "partner"
        return "bystander" if self.tp_size != self.tp_size_reduced else "uniform"


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
    # replicas that leave the job (policy "drop"): their ranks are not active
    dropped: tuple[int, ...] = ()

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
        healthy = replicas - len(failed)
        if config.drops and not healthy:
            raise ValueError(
                f"--ntp-policy drop: every one of the {replicas} replicas lost GPUs, so none would be left; "
                "use --ntp-policy degrade (every replica at the reduced degree, a uniform job)"
            )
        if failed and not config.drops and 0 < healthy < len(failed):
            raise ValueError(
                f"--ntp-failed-slots lists {len(failed)} degraded replica(s) but the job has only {healthy} "
                f"healthy one(s): every degraded replica needs its own healthy partner. List every replica in "
                f"--ntp-failed-slots to run all {replicas} at TP {config.tp_reduced} (a uniform job), or drop "
                "the degraded replicas from the job"
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
        dropped = tuple(sorted(failed)) if config.drops else ()
        return cls(b, config.tp_reduced, replicas, config.launch_mode, tuple(rank_of), dict(failed), dropped)

    def after_leaving(self) -> "NTPLayout":
        """The layout the active ranks train in once the others left (the failed slots' processes
        in simulate mode, the dropped replicas'): ranks renumbered in order (packed), dropped
        replicas gone and the others renumbered."""
        order = {g: i for i, g in enumerate(self.active_ranks)}
        keep = [d for d in range(self.num_replicas) if d not in self.dropped]
        rank_of = tuple(
            tuple(order[r] if s in self.active_slots(d) else None for s, r in enumerate(self.rank_of[d])) for d in keep
        )
        failed = {i: self.failed[d] for i, d in enumerate(keep) if d in self.failed}
        reduced = self.tp_reduced if failed else self.tp_base  # nothing degraded is left: a uniform job
        return NTPLayout(self.tp_base, reduced, len(keep), "packed", rank_of, failed)

    @property
    def leaving(self) -> list[int]:
        """Ranks that have a process but no place in training (simulate mode's failed slots, dropped replicas)."""
        launched = [r for row in self.rank_of for r in row if r is not None]
        return sorted(set(launched) - set(self.active_ranks))

    # ---- replicas -----------------------------------------------------------
    def is_degraded(self, replica: int) -> bool:
        return replica in self.failed

    @property
    def degraded_replicas(self) -> list[int]:
        return sorted(self.failed)

    @property
    def healthy_replicas(self) -> list[int]:
        return [d for d in range(self.num_replicas) if d not in self.failed]

    @property
    def nonuniform(self) -> bool:
        """True when replicas run at two TP degrees (else the job is uniform)."""
        return self.tp_reduced != self.tp_base and bool(self.failed) and bool(self.healthy_replicas)

    @property
    def partners(self) -> dict[int, int]:
        """Degraded replica -> its healthy partner (the k-th degraded with the k-th healthy)."""
        if not self.nonuniform:
            return {}
        return pair_up(self.degraded_replicas, self.healthy_replicas)

    def partner_of(self, replica: int) -> int | None:
        """The other side of ``replica``'s pair, or None (bystander, uniform job)."""
        pairs = self.partners
        if replica in pairs:
            return pairs[replica]
        return next((d for d, p in pairs.items() if p == replica), None)

    # ---- groups -------------------------------------------------------------
    def active_slots(self, replica: int) -> list[int]:
        return [s for s in range(self.tp_base) if s not in self.failed.get(replica, ())]

    def tp_group_ranks(self, replica: int) -> list[int]:
        """Global ranks of a replica's TP group, in TP-rank order."""
        return [self.rank_of[replica][s] for s in self.active_slots(replica)]

    def all_tp_groups(self) -> list[list[int]]:
        return [self.tp_group_ranks(d) for d in range(self.num_replicas)]

    def all_dp_groups(self) -> list[list[int]]:
        """Every rank's DP group, each once: in a nonuniform job the healthy replicas' rank ``j``
        for each TP rank ``j``, then every degraded rank alone; in a uniform job rank ``i`` of
        every replica."""
        if not self.nonuniform:
            tp = len(self.tp_group_ranks(0))
            return [[self.tp_group_ranks(d)[i] for d in range(self.num_replicas)] for i in range(tp)]
        groups = [[self.tp_group_ranks(d)[j] for d in self.healthy_replicas] for j in range(self.tp_base)]
        return groups + [[r] for d in self.degraded_replicas for r in self.tp_group_ranks(d)]

    def pair_group_ranks(self, degraded: int) -> list[int]:
        """The ranks of one degraded replica and its partner (the gradient and parameter transfers)."""
        return sorted(self.tp_group_ranks(self.partners[degraded]) + self.tp_group_ranks(degraded))

    def all_pair_groups(self) -> list[list[int]]:
        return [self.pair_group_ranks(d) for d in self.partners]

    def optimizer_groups(self) -> list[list[int]]:
        """The ranks whose optimizers reduce gradient statistics together (the distributed
        optimizer's instance): all healthy ranks; each degraded replica alone (its optimizer
        owns nothing). In a uniform job: all ranks."""
        if not self.nonuniform:
            return [self.active_ranks]
        healthy = sorted(r for d in self.healthy_replicas for r in self.tp_group_ranks(d))
        return [healthy] + [self.tp_group_ranks(d) for d in self.degraded_replicas]

    @property
    def world_size(self) -> int:
        return sum(r is not None for row in self.rank_of for r in row)

    @property
    def active_ranks(self) -> list[int]:
        return sorted(r for d in range(self.num_replicas) if d not in self.dropped for r in self.tp_group_ranks(d))

    def role(self, rank: int) -> RankRole | None:
        """This rank's place, or ``None`` for a non-active rank (simulate mode, dropped replicas)."""
        for d in range(self.num_replicas):
            if d in self.dropped:
                continue
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
                    partner=self.partner_of(d),
                )
        return None
