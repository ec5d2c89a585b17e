"""Rank layout of an NTP job: which global ranks form which TP, pipeline, DP and partner groups.

Replica ``d`` spans ``pp`` pipeline stages; each stage has TP slots ``0..tp_base-1``.
A degraded replica runs every stage at ``tp_reduced`` (parity across stages, so the
activations passed from stage to stage keep their shapes): its active slots of stage ``p``,
in slot order, are its TP ranks ``0..tp_reduced-1`` there. A healthy replica's slot is its
TP rank. A replica that lost GPUs in any stage is degraded in every stage.

Healthy replicas form a uniform ``tp_base`` job among themselves: the DP group of stage
``p``, TP rank ``j`` holds that rank of every healthy replica. Each degraded replica is a
*satellite* of one healthy *partner* replica (the ``k``-th degraded replica, in index
order, of the ``k``-th healthy one), stage by stage: the gradients of its stage ``p`` go to
the partner's stage ``p`` before the partner's DP collective, and the updated parameters
come back from there. A degraded replica takes part in no DP collective; its DP group is the
rank alone. The healthy replicas that are nobody's partner are *bystanders*: a uniform
job's ranks.

When every replica is degraded (or none is), the job is uniform: all replicas at one
degree, DP groups over all of them.

Global ranks, stage-major as Megatron numbers TP x DP x PP (``tp-dp-pp``): ``packed``
numbers the active slots stage by stage, replica by replica, skipping the inactive ones
(world = active GPUs); ``simulate`` gives slot ``s`` of replica ``d`` in stage ``p`` rank
``(p * replicas + d) * tp_base + s`` and the inactive slots are processes that leave. Every
stage then has the same number of active ranks, in the same (replica, TP rank) order, so
Megatron's own pipeline and embedding groups at TP 1 (rank ``i`` of every stage) are the
NTP job's: :func:`~.process_groups.initialize_nonuniform_tp_process_groups` keeps them.
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
    stage: int = 0

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
    # rank_of[p][d][s]: global rank of slot s of replica d in stage p; None for an inactive slot
    # in packed mode. In simulate mode inactive slots keep a (leaving) rank.
    rank_of: tuple[tuple[tuple[int | None, ...], ...], ...]
    # (replica, stage) -> its inactive TP slots; every stage of a degraded replica is listed
    failed: dict
    # replicas that leave the job (policy "drop"): their ranks are not active
    dropped: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config, world_size: int) -> "NTPLayout":
        b, pp, failed = config.tp_base, config.pipeline_model_parallel_size, config.failed_slots_by_stage
        n_failed = sum(len(s) for s in failed.values())
        if config.launch_mode == "simulate":
            if world_size % (b * pp):
                raise ValueError(
                    f"launch_mode='simulate' needs a process for every slot: world size {world_size} "
                    f"must be a multiple of tp_base={b}" + (f" x pipeline_model_parallel_size={pp}" if pp > 1 else "")
                )
            replicas = world_size // (b * pp)
        else:
            if (world_size + n_failed) % (b * pp):
                raise ValueError(
                    f"launch_mode='packed': world size {world_size} + {n_failed} failed GPU(s) is not a "
                    f"multiple of tp_base={b}"
                    + (f" x pipeline_model_parallel_size={pp}" if pp > 1 else "")
                    + f"; launch exactly the healthy GPUs (non_active_ranks_per_dp={config.non_active_ranks_per_dp})"
                )
            replicas = (world_size + n_failed) // (b * pp)
        if config.data_parallel_size is not None and config.data_parallel_size != replicas:
            expected = config.data_parallel_size * b * pp - (0 if config.launch_mode == "simulate" else n_failed)
            raise ValueError(
                f"NonuniformTPConfig.data_parallel_size={config.data_parallel_size} does not match world "
                f"size {world_size} (launch_mode={config.launch_mode!r} expects {expected} processes)"
            )
        degraded = sorted({d for d, _ in failed})
        bad = [d for d in degraded if d >= replicas]
        if bad:
            raise ValueError(
                f"NonuniformTPConfig.non_active_ranks_per_dp names replica(s) {bad} but the job has "
                f"{replicas} replicas (allowed: 0..{replicas - 1})"
            )
        healthy = replicas - len(degraded)
        if config.drops and not healthy:
            raise ValueError(
                f"--ntp-policy drop: every one of the {replicas} replicas lost GPUs, so none would be left; "
                "use --ntp-policy degrade (every replica at the reduced degree, a uniform job)"
            )
        if degraded and not config.drops and 0 < healthy < len(degraded):
            raise ValueError(
                f"--ntp-failed-slots lists {len(degraded)} degraded replica(s) but the job has only {healthy} "
                f"healthy one(s): every degraded replica needs its own healthy partner. List every replica in "
                f"--ntp-failed-slots to run all {replicas} at TP {config.tp_reduced} (a uniform job), or drop "
                "the degraded replicas from the job"
            )
        rank_of, nxt = [], 0
        for p in range(pp):
            stage = []
            for d in range(replicas):
                row = []
                for s in range(b):
                    if config.launch_mode == "simulate":
                        row.append((p * replicas + d) * b + s)
                    elif s in failed.get((d, p), ()):
                        row.append(None)
                    else:
                        row.append(nxt)
                        nxt += 1
                stage.append(tuple(row))
            rank_of.append(tuple(stage))
        dropped = tuple(degraded) if config.drops else ()
        return cls(b, config.tp_reduced, replicas, config.launch_mode, tuple(rank_of), dict(failed), dropped)

    def after_leaving(self) -> "NTPLayout":
        """The layout the active ranks train in once the others left (the inactive slots' processes
        in simulate mode, the dropped replicas'): ranks renumbered in order (packed), dropped
        replicas gone and the others renumbered."""
        order = {g: i for i, g in enumerate(self.active_ranks)}
        keep = [d for d in range(self.num_replicas) if d not in self.dropped]
        rank_of = tuple(
            tuple(
                tuple(order[r] if s in self.active_slots(d, p) else None for s, r in enumerate(self.rank_of[p][d]))
                for d in keep
            )
            for p in range(self.pp)
        )
        index = {d: i for i, d in enumerate(keep)}
        failed = {(index[d], p): slots for (d, p), slots in self.failed.items() if d in index}
        reduced = self.tp_reduced if failed else self.tp_base  # nothing degraded is left: a uniform job
        return NTPLayout(self.tp_base, reduced, len(keep), "packed", rank_of, failed)

    @property
    def pp(self) -> int:
        """Pipeline stages of every replica."""
        return len(self.rank_of)

    @property
    def leaving(self) -> list[int]:
        """Ranks that have a process but no place in training (simulate mode's inactive slots, dropped replicas)."""
        launched = [r for stage in self.rank_of for row in stage for r in row if r is not None]
        return sorted(set(launched) - set(self.active_ranks))

    # ---- replicas -----------------------------------------------------------
    def is_degraded(self, replica: int) -> bool:
        return replica in self.degraded_replicas

    @property
    def degraded_replicas(self) -> list[int]:
        return sorted({d for d, _ in self.failed})

    @property
    def healthy_replicas(self) -> list[int]:
        degraded = set(self.degraded_replicas)
        return [d for d in range(self.num_replicas) if d not in degraded]

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
    def active_slots(self, replica: int, stage: int = 0) -> list[int]:
        return [s for s in range(self.tp_base) if s not in self.failed.get((replica, stage), ())]

    def tp_group_ranks(self, replica: int, stage: int = 0) -> list[int]:
        """Global ranks of a replica's TP group in one stage, in TP-rank order."""
        return [self.rank_of[stage][replica][s] for s in self.active_slots(replica, stage)]

    def replica_ranks(self, replica: int) -> list[int]:
        """Every global rank of a replica, all stages (its model-parallel group)."""
        return sorted(r for p in range(self.pp) for r in self.tp_group_ranks(replica, p))

    def all_tp_groups(self) -> list[list[int]]:
        """Every TP group, stage by stage, replica by replica."""
        return [self.tp_group_ranks(d, p) for p in range(self.pp) for d in range(self.num_replicas)]

    def all_pipeline_groups(self) -> list[list[int]]:
        """Every pipeline group: TP rank ``i`` of a replica in each stage, in stage order."""
        return [
            [self.tp_group_ranks(d, p)[i] for p in range(self.pp)]
            for d in range(self.num_replicas)
            for i in range(len(self.tp_group_ranks(d, 0)))
        ]

    def all_model_parallel_groups(self) -> list[list[int]]:
        """Every replica's ranks over all its stages (Megatron's model-parallel group, TP x PP)."""
        return [self.replica_ranks(d) for d in range(self.num_replicas)]

    def all_dp_groups(self) -> list[list[int]]:
        """Every rank's DP group, each once, stage by stage: in a nonuniform job the healthy
        replicas' rank ``j`` for each TP rank ``j``, then every degraded rank alone; in a uniform
        job rank ``i`` of every replica."""
        groups = []
        for p in range(self.pp):
            if not self.nonuniform:
                tp = len(self.tp_group_ranks(0, p))
                groups += [[self.tp_group_ranks(d, p)[i] for d in range(self.num_replicas)] for i in range(tp)]
                continue
            groups += [[self.tp_group_ranks(d, p)[j] for d in self.healthy_replicas] for j in range(self.tp_base)]
            groups += [[r] for d in self.degraded_replicas for r in self.tp_group_ranks(d, p)]
        return groups

    def pair_group_ranks(self, degraded: int, stage: int = 0) -> list[int]:
        """The ranks of one degraded replica and its partner in one stage (the gradient and
        parameter transfers of that stage's layers)."""
        return sorted(self.tp_group_ranks(self.partners[degraded], stage) + self.tp_group_ranks(degraded, stage))

    def all_pair_groups(self) -> list[list[int]]:
        return [self.pair_group_ranks(d, p) for p in range(self.pp) for d in self.partners]

    def optimizer_groups(self) -> list[list[int]]:
        """The ranks whose optimizers reduce gradient statistics together (the distributed
        optimizer's instance): all healthy ranks, every stage; each degraded replica alone (its
        optimizer owns nothing). In a uniform job: all ranks."""
        if not self.nonuniform:
            return [self.active_ranks]
        healthy = sorted(r for d in self.healthy_replicas for r in self.replica_ranks(d))
        return [healthy] + [self.replica_ranks(d) for d in self.degraded_replicas]

    def stage_optimizer_groups(self) -> list[list[int]]:
        """:meth:`optimizer_groups` within each stage (Megatron's TP x DP group): per stage, its
        healthy ranks, then each degraded replica's ranks there. With one stage, the same groups."""
        if self.pp == 1:
            return self.optimizer_groups()
        groups = []
        for p in range(self.pp):
            if not self.nonuniform:
                groups.append(sorted(r for d in self._kept for r in self.tp_group_ranks(d, p)))
                continue
            groups.append(sorted(r for d in self.healthy_replicas for r in self.tp_group_ranks(d, p)))
            groups += [self.tp_group_ranks(d, p) for d in self.degraded_replicas]
        return groups

    @property
    def _kept(self) -> list[int]:
        return [d for d in range(self.num_replicas) if d not in self.dropped]

    @property
    def world_size(self) -> int:
        return sum(r is not None for stage in self.rank_of for row in stage for r in row)

    @property
    def active_ranks(self) -> list[int]:
        return sorted(r for d in self._kept for r in self.replica_ranks(d))

    def role(self, rank: int) -> RankRole | None:
        """This rank's place, or ``None`` for a non-active rank (simulate mode, dropped replicas)."""
        for p in range(self.pp):
            for d in self._kept:
                ranks = self.tp_group_ranks(d, p)
                if rank in ranks:
                    return RankRole(
                        replica=d,
                        slot=self.active_slots(d, p)[ranks.index(rank)],
                        tp_rank=ranks.index(rank),
                        tp_size=len(ranks),
                        degraded=self.is_degraded(d),
                        tp_size_reduced=self.tp_reduced,
                        partner=self.partner_of(d),
                        stage=p,
                    )
        return None
