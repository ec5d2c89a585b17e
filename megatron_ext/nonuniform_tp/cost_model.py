"""Cost model of a nonuniform-TP job: the step time and retained throughput of a data-parallel job
whose replicas lost GPUs, for each way to go on -- degrade (NTP), drop the replicas that lost GPUs,
run every replica at the reduced degree -- and the best of them (:func:`best_plan`, the policy).
Pure Python (no torch): product code decides with it; ``benchmarks/ntp.py`` checks it against a
measured run and prints it for large jobs.

The job: ``len(failed)`` replicas, each a pipeline of ``pp`` stages of ``tp`` GPUs (``pp * tp`` GPUs
per replica). ``failed[d]`` is replica ``d``'s loss: the GPUs its worst stage lost (an int), or the
losses of its ``pp`` stages (a sequence; the worst counts). A replica whose worst stage lost every
GPU is *dead* (gone in every plan). A replica that lost some is *degraded* and runs every stage at
one reduced degree (stage-to-stage activations keep their shapes); all degraded replicas run at one
degree ``r`` (default ``tp`` minus the largest loss: spare parity). ``H`` healthy replicas, ``D``
degraded ones. Dropping a replica removes its ``pp * tp`` GPUs.

A plan gives every replica it keeps a role, a TP degree and a share of the global batch of ``M``
micro-batches (``m_d``), and takes::

    step = max_d((m_d + pp - 1) * t_d / pp + o_d) + (sync(n) + optimizer_s) * L / pp + other_s

- ``t_d``, one micro-batch's forward and backward through the whole model: ``microbatch_s`` at TP
  ``tp``, and ``microbatch_s * tp / r / degraded_efficiency`` at TP ``r``. Each replica runs its own
  1F1B pipeline over its own ``m_d`` micro-batches: every stage takes ``t_d / pp`` per micro-batch,
  the schedule ``m_d + pp - 1`` of those (the bubble). At ``pp = 1``: ``m_d * t_d``.
- ``o_d``, the transfers of a degraded replica and its partner, paid by both, by no one else
  (bystanders pay nothing): ``(grad_transfer_s + param_transfer_s) * tp / r / pp``. :class:`StepCosts`
  gives the transfers per healthy rank's shard at ``pp = 1``; a satellite's rank holds ``tp / r`` of
  that, and sends and receives it; each stage exchanges only its own layers with the partner's same
  stage, all stages at once (``1 / pp``). None of it is hidden: the satellite's gradients join the
  partner's buckets before its DP collective, the parameters come back after its optimizer step.
- ``sync(n)``, the DP gradient collective over the ``n`` replicas that take part (the healthy ones;
  satellites take part in none), as a ring all-reduce: ``sync_s * ring(n) / ring(sync_replicas)``
  with ``ring(n) = 2(n-1)/n``. It and the optimizer step run on every stage at once, each over its
  ``1 / pp`` of the model.
- ``L``, the layout factor: 1 where the collective and the optimizer run at ``tp`` (uniform, drop,
  NTP), ``tp / r`` when every replica runs at ``r`` (each rank then holds ``1/r`` of its stage).

Shares are integers (micro-batch granularity; every replica a plan keeps takes at least one) or,
with ``fluid=True``, real numbers (the limit of many small micro-batches). Balanced integer shares
minimise the step exactly (each further micro-batch goes to the replica that finishes it first, its
transfers and bubble counted), so a partner and its satellite take fewer micro-batches than their
speeds alone would give them and the bystanders take more; with ``pp > 1`` a satellite's longer bubble
(``(pp - 1) * t_d / pp``) takes it further below its speed's share.

Plans (:data:`MODES`):

- ``"drop"``: the degraded replicas leave; the healthy ones share the global batch.
- ``"ntp balanced"``: every degraded replica is the satellite of its own healthy partner (the
  ``k``-th degraded of the ``k``-th healthy), shares balanced. Refused (None) when ``D > H``.
- ``"ntp unbalanced"``: the same with the most even shares.
- ``"all at r"``: every live replica at TP ``r``, a uniform job (what the layout runs when every
  replica is listed as degraded); healthy replicas leave ``tp - r`` GPUs idle.
- ``"ntp shrink"``: every replica keeps its per-step work: the healthy ones their uniform share,
  each satellite what it computes in the same time; the global batch shrinks by the satellites'
  shortfall, at most ``max_shrink`` of it (satellites take more, and the step grows, beyond that).
  A different global batch per step: it changes the optimisation, not only the speed.
- ``"ntp policy"``: the best of ``"drop"``, keeping ``j = 1..min(D, H)`` satellites (balanced shares,
  the other degraded replicas dropped) and ``"all at r"``. ``j = 0`` is the drop plan, so the policy
  is never worse than dropping, at the same global batch.

Retained throughput (:func:`predict_retained`): micro-batches per second over the uniform job's on
every replica (``dp`` replicas at ``tp``, the same ``pp``, the same global batch, most even shares).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

__all__ = [
    "DEFAULT_MAX_SHRINK",
    "MODES",
    "PLACEMENTS",
    "Plan",
    "StepCosts",
    "best_plan",
    "large_job_table",
    "place_failures",
    "plan_step",
    "predict_retained",
    "reduced_degree",
    "ring_factor",
    "uniform_plan",
    "verdict",
]

MODES = ("ntp policy", "ntp balanced", "ntp unbalanced", "drop", "all at r", "ntp shrink")
PLACEMENTS = ("spread", "packed")
_PAIR = ("partner", "satellite")  # the roles that pay a pair's transfers
DEFAULT_MAX_SHRINK = 0.05


def ring_factor(n: int) -> float:
    """Bytes a ring all-reduce puts on each rank's link per byte of the buffer: ``2(n-1)/n`` (0 for one replica)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"ring_factor: n must be an int >= 1 (replicas in the collective), got {n!r}")
    return 2.0 * (n - 1) / n


def _finite(value, at_least_zero: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isinf(value) or value != value:
        return False
    return value >= 0 if at_least_zero else value > 0


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """One healthy replica's step, in seconds, split into the parts the model scales.

    - ``microbatch_s``: forward + backward of one micro-batch at TP ``tp``.
    - ``sync_s``: the data-parallel gradient collective (no waiting), measured over ``sync_replicas``
      replicas (an int >= 2).
    - ``optimizer_s``: the optimizer step at TP ``tp``.
    - ``other_s``: the rest of a step (zero_grad, the loop, barriers).
    - ``grad_transfer_s``, ``param_transfer_s``: a degraded replica's gradient transfer to its partner
      and the parameter transfer back, per step, for one healthy rank's shard (the model's ``1/tp``,
      without pipeline stages): at TP ``r`` they take ``tp / r`` times as long (:meth:`transfer_s`).
    - ``degraded_efficiency``: a degraded replica's compute per GPU relative to a healthy one's (1.0: a
      replica at TP ``r`` needs ``tp / r`` times the healthy time per micro-batch).
    """

    microbatch_s: float
    sync_s: float = 0.0
    sync_replicas: int = 2
    optimizer_s: float = 0.0
    other_s: float = 0.0
    grad_transfer_s: float = 0.0
    param_transfer_s: float = 0.0
    degraded_efficiency: float = 1.0

    def __post_init__(self):
        if not _finite(self.microbatch_s, at_least_zero=False):
            raise ValueError(f"StepCosts.microbatch_s must be a finite number > 0, got {self.microbatch_s!r}")
        for name in ("sync_s", "optimizer_s", "other_s", "grad_transfer_s", "param_transfer_s"):
            value = getattr(self, name)
            if not _finite(value, at_least_zero=True):
                raise ValueError(f"StepCosts.{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.sync_replicas, int) or isinstance(self.sync_replicas, bool) or self.sync_replicas < 2:
            raise ValueError(
                f"StepCosts.sync_replicas must be an int >= 2 (the DP size sync_s was measured at), "
                f"got {self.sync_replicas!r}"
            )
        if not _finite(self.degraded_efficiency, at_least_zero=False):
            raise ValueError(
                f"StepCosts.degraded_efficiency must be a finite number > 0, got {self.degraded_efficiency!r}"
            )

    def microbatch_at(self, tp: int, degree: int) -> float:
        """Seconds of one micro-batch on a replica at TP ``degree`` of a ``tp`` job."""
        if degree == tp:
            return self.microbatch_s
        return self.microbatch_s * tp / degree / self.degraded_efficiency

    def transfer_s(self, tp: int, degree: int) -> float:
        """A pair's gradient + parameter transfers per step with the satellite at TP ``degree`` (one stage)."""
        return (self.grad_transfer_s + self.param_transfer_s) * tp / degree

    def sync_at(self, replicas: int) -> float:
        """The DP collective over ``replicas`` replicas at TP ``tp`` (ring all-reduce scaling)."""
        return self.sync_s * ring_factor(replicas) / ring_factor(self.sync_replicas)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to run a step, and its predicted time.

    ``choice``: what it does (``"uniform"``, ``"drop"``, ``"ntp"``, ``"all at r"``, ``"ntp shrink"``).
    Per replica the plan keeps, in replica order: ``replicas`` (indices in the job), ``roles``
    (``"replica"`` in uniform jobs, drop and all-at-r plans; else ``"bystander"``, ``"partner"``,
    ``"satellite"``), ``degrees`` (TP), ``shares`` (micro-batches; ints unless fluid) and ``busy_s``
    (the pipeline's compute + transfers). ``step_s``: the step; ``microbatches``: micro-batches it
    processes (less than ``requested`` under ``"ntp shrink"`` only); ``kept`` / ``dropped``: degraded
    replicas kept as satellites (or at TP ``r``) / dropped; ``pp``: pipeline stages per replica."""

    mode: str
    choice: str
    tp: int
    tp_reduced: int | None
    replicas: tuple[int, ...]
    roles: tuple[str, ...]
    degrees: tuple[int, ...]
    shares: tuple[float, ...]
    busy_s: tuple[float, ...]
    dp_replicas: int
    step_s: float
    microbatches: float
    requested: int
    kept: int
    dropped: int
    pp: int = 1

    @property
    def gpus(self) -> int:
        """GPUs that compute: ``pp`` x the TP degree of every replica the plan keeps."""
        return self.pp * sum(self.degrees)

    @property
    def throughput(self) -> float:
        """Micro-batches per second."""
        return self.microbatches / self.step_s

    @property
    def batch_fraction(self) -> float:
        """Micro-batches processed per step over the global batch asked for (1.0 except under shrink)."""
        return self.microbatches / self.requested

    def describe(self) -> str:
        if self.choice == "ntp":
            what = f"keep {self.kept} degraded replica(s) at TP {self.tp_reduced}"
            return what + (f", drop {self.dropped}" if self.dropped else "")
        if self.choice == "all at r":
            return f"every replica at TP {self.tp_reduced}"
        if self.choice == "ntp shrink":
            return f"keep {self.kept} at TP {self.tp_reduced}, batch {self.batch_fraction:.2%}"
        if self.choice == "drop":
            return f"drop {self.dropped} degraded replica(s)" if self.dropped else "no degraded replica"
        return self.choice


def place_failures(dp: int, tp: int, k: int, placement: str, pp: int = 1) -> tuple[int, ...]:
    """Each replica's loss (its worst stage's failed GPUs) for ``k`` failures among ``dp`` replicas of
    ``pp`` stages of ``tp`` GPUs: ``spread`` deals them one per replica in turn (replica 0 first), a
    replica's to its stages in turn; ``packed`` fills replica 0 stage by stage, then replica 1, ..."""
    _check_pp(pp)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not 0 <= k <= dp * pp * tp:
        raise ValueError(f"k={k} failed GPUs: must be in 0..{'dp*tp' if pp == 1 else 'dp*pp*tp'} = {dp * pp * tp}")
    if placement == "spread":
        return tuple(-(-(k // dp + (d < k % dp)) // pp) for d in range(dp))  # ceil over the stages
    return tuple(min(tp, max(0, k - d * pp * tp)) for d in range(dp))


def reduced_degree(tp: int, failed: Sequence, sizes: Sequence[int] = (), *, pp: int = 1) -> int | None:
    """The TP degree of the degraded replicas (every stage of them): ``tp`` minus the largest loss of a
    (replica, stage) of a replica that is not dead (spare parity), lowered until it divides every one
    of ``sizes`` (e.g. attention heads, query groups, ffn width, vocab: what must split at that degree).
    None when no replica is degraded. ``failed``: as in :func:`plan_step`."""
    failed = _check_failed(tp, failed, pp)
    losses = [f for f in failed if 0 < f < tp]
    if not losses:
        return None
    r = tp - max(losses)
    while r > 1 and any(s % r for s in sizes):
        r -= 1
    return r


def _check_pp(pp) -> None:
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pp must be an int >= 1 (pipeline stages per replica), got {pp!r}")


def _check_failed(tp: int, failed, pp: int = 1) -> tuple[int, ...]:
    """Per replica, its worst stage's loss."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    _check_pp(pp)
    failed = tuple(failed)
    per_stage = [list(f) if isinstance(f, (tuple, list)) and len(f) == pp else [None] for f in failed]
    stages = [[f] if isinstance(f, int) else s for f, s in zip(failed, per_stage)]
    if not failed or any(not isinstance(x, int) or not 0 <= x <= tp for s in stages for x in s):
        raise ValueError(
            f"failed must list, per replica, the GPUs it lost (ints in 0..tp={tp}: its worst stage's, or a list of "
            f"its pp={pp} stages'), got {list(failed)}"
        )
    return tuple(max(s) for s in stages)


def _even(total: int, n: int) -> list[int]:
    return [total // n + (i < total % n) for i in range(n)]


def _balanced_int(times: list[float], offsets: list[float], total: int) -> list[int]:
    """Integer shares >= 1 minimising ``max(m_d * t_d + o_d)`` with ``sum(m_d) = total``: each further
    micro-batch goes to the replica that would finish it first (exact for increasing costs)."""
    counts = [1] * len(times)
    heap = [(2 * t + o, d) for d, (t, o) in enumerate(zip(times, offsets))]
    heapq.heapify(heap)
    for _ in range(total - len(times)):
        _, d = heapq.heappop(heap)
        counts[d] += 1
        heapq.heappush(heap, ((counts[d] + 1) * times[d] + offsets[d], d))
    return counts


def _balanced_fluid(times: list[float], offsets: list[float], total: float) -> list[float]:
    """Real shares >= 0 minimising ``max(m_d * t_d + o_d)`` with ``sum(m_d) = total`` (water filling:
    every replica with a share finishes at one level)."""
    order = sorted(range(len(times)), key=lambda d: offsets[d])
    level, active = 0.0, []
    for i, d in enumerate(order):
        active.append(d)
        level = (total + sum(offsets[a] / times[a] for a in active)) / sum(1 / times[a] for a in active)
        if i + 1 == len(order) or level <= offsets[order[i + 1]]:
            break
    return [max(0.0, (level - offsets[d]) / times[d]) if d in active else 0.0 for d in range(len(times))]


def _classify(tp: int, failed: tuple[int, ...]) -> tuple[list[int], list[int]]:
    healthy = [d for d, f in enumerate(failed) if f == 0]
    degraded = [d for d, f in enumerate(failed) if 0 < f < tp]
    return healthy, degraded


def _pipeline(t: float, o: float, pp: int) -> tuple[float, float]:
    """A replica's busy time as ``m * per + fixed``: ``m`` micro-batches of ``t`` (whole model) through a
    1F1B pipeline of ``pp`` stages, ``(m + pp - 1) * t / pp``, and transfers ``o`` (at ``pp = 1``) split
    over the stages."""
    return t / pp, ((pp - 1) * t + o) / pp


def _make_plan(costs, mode, choice, tp, r, members, shares, microbatches, requested, kept, dropped, layout=1.0, *, pp):
    """``members``: [(replica, role, degree)] in replica order; ``shares`` per member."""
    busy = []
    for (_, role, degree), m in zip(members, shares):
        o = costs.transfer_s(tp, r) if role in _PAIR else 0.0
        per, fixed = _pipeline(costs.microbatch_at(tp, degree), o, pp)
        busy.append(m * per + fixed)
    dp_replicas = sum(role != "satellite" for _, role, _ in members)
    step = max(busy) + (costs.sync_at(dp_replicas) + costs.optimizer_s) * layout / pp + costs.other_s
    return Plan(
        mode=mode,
        choice=choice,
        tp=tp,
        tp_reduced=r,
        replicas=tuple(d for d, _, _ in members),
        roles=tuple(role for _, role, _ in members),
        degrees=tuple(degree for _, _, degree in members),
        shares=tuple(shares),
        busy_s=tuple(busy),
        dp_replicas=dp_replicas,
        step_s=step,
        microbatches=microbatches,
        requested=requested,
        kept=kept,
        dropped=dropped,
        pp=pp,
    )


def _check_total(microbatches: int, replicas: int) -> None:
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < replicas:
        raise ValueError(
            f"{microbatches!r} micro-batches for {replicas} replicas: each replica needs at least one; use more "
            "micro-batches per global batch"
        )


def uniform_plan(costs: StepCosts, dp: int, tp: int, microbatches: int, *, fluid: bool = False, pp: int = 1) -> Plan:
    """The job without a failure: ``dp`` replicas of ``pp`` stages at ``tp``, the most even shares
    (``fluid``: equal)."""
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be an int >= 1, got {dp!r}")
    _check_pp(pp)
    _check_total(microbatches, dp)
    members = [(d, "replica", tp) for d in range(dp)]
    shares = [microbatches / dp] * dp if fluid else _even(microbatches, dp)
    return _make_plan(costs, "uniform", "uniform", tp, None, members, shares, microbatches, microbatches, 0, 0, pp=pp)


def plan_step(
    costs: StepCosts,
    tp: int,
    failed: Sequence[int],
    microbatches: int,
    mode: str,
    *,
    fluid: bool = False,
    shares: Sequence[float] | None = None,
    keep: int | None = None,
    tp_reduced: int | None = None,
    max_shrink: float = DEFAULT_MAX_SHRINK,
    pp: int = 1,
) -> Plan | None:
    """The :class:`Plan` of ``mode`` (:data:`MODES`) for a job of ``len(failed)`` replicas of ``pp``
    pipeline stages of ``tp`` GPUs whose replica ``d`` lost ``failed[d]`` GPUs (an int: its worst stage's
    loss; or a list of its ``pp`` stages' losses), with global batches of ``microbatches`` micro-batches;
    None where the mode cannot run (NTP with more degraded replicas than healthy ones: each needs its
    own partner; drop with no healthy replica).

    ``shares``: the micro-batches of every replica the plan keeps, in replica order, instead of the
    mode's own (to predict a run with given shares). ``keep``: with the NTP modes, the number of
    degraded replicas kept as satellites (the first ones; the others are dropped; default all).
    ``tp_reduced``: the degraded replicas' degree (default :func:`reduced_degree`). ``max_shrink``:
    the largest fraction of the global batch ``"ntp shrink"`` may leave out. With no degraded replica
    every mode is the drop plan (the healthy replicas share the batch)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    failed = _check_failed(tp, failed, pp)
    _check_total(microbatches, len(failed))
    if not 0 <= max_shrink < 1:
        raise ValueError(f"max_shrink must be in [0, 1) (a fraction of the global batch), got {max_shrink!r}")
    if mode == "ntp policy":
        if shares is not None or keep is not None:
            raise ValueError("plan_step: mode 'ntp policy' chooses its shares and satellites; pass neither")
        return best_plan(costs, tp, failed, microbatches, fluid=fluid, tp_reduced=tp_reduced, pp=pp)
    healthy, degraded = _classify(tp, failed)
    if not healthy and not degraded:
        raise ValueError(f"every replica lost every GPU (failed={list(failed)}): nothing is left to train")
    r = reduced_degree(tp, failed) if tp_reduced is None else tp_reduced
    if degraded and (not isinstance(r, int) or not 1 <= r <= tp - max(failed[d] for d in degraded)):
        raise ValueError(
            f"tp_reduced={tp_reduced!r}: must be an int in 1..{tp - max(failed[d] for d in degraded)} (tp minus "
            "the largest loss of a degraded replica's stage)"
        )
    if not degraded or mode == "drop":
        keep_n = 0
    elif mode == "all at r":
        keep_n = len(degraded)
    else:
        keep_n = len(degraded) if keep is None else keep
        if not isinstance(keep_n, int) or not 0 <= keep_n <= len(degraded):
            raise ValueError(f"keep must be an int in 0..{len(degraded)} (the degraded replicas), got {keep!r}")
        if keep_n > len(healthy):
            return None  # the layout refuses: every satellite needs its own healthy partner
    if not healthy and keep_n == 0:
        return None  # drop with no healthy replica: nothing left
    kept = degraded[:keep_n]
    dropped = len(degraded) - keep_n
    finish = dict(fluid=fluid, shares=shares, pp=pp)
    if mode == "all at r" and degraded:
        members = [(d, "replica", r) for d in sorted(healthy + kept)]
        return _finish(costs, mode, "all at r", tp, r, members, microbatches, keep_n, dropped, tp / r, **finish)
    partners = dict(zip(healthy, kept))  # the k-th healthy replica is the k-th kept satellite's partner
    members = []
    for d in sorted(healthy + kept):
        if d in kept:
            members.append((d, "satellite", r))
        else:
            members.append((d, "partner" if d in partners else ("bystander" if kept else "replica"), tp))
    if not kept:
        return _finish(costs, mode, "drop", tp, r, members, microbatches, 0, dropped, **finish)
    if mode == "ntp shrink":
        return _shrink(costs, tp, r, members, microbatches, fluid, max_shrink, dropped, pp)
    balanced = mode == "ntp balanced"
    return _finish(costs, mode, "ntp", tp, r, members, microbatches, keep_n, dropped, balanced=balanced, **finish)


def _finish(costs, mode, choice, tp, r, members, total, kept, dropped, layout=1.0, *, fluid, shares, pp, balanced=True):
    n = len(members)
    if shares is not None:
        shares = list(shares)
        bad = any(not _finite(m, at_least_zero=True) for m in shares)
        if len(shares) != n or bad or not math.isclose(sum(shares), total, rel_tol=1e-9):
            raise ValueError(
                f"shares must list {n} numbers >= 0 (one per replica the plan keeps, in replica order) summing to "
                f"{total}, got {shares}"
            )
    elif balanced:
        times, offsets = zip(
            *(
                _pipeline(costs.microbatch_at(tp, degree), costs.transfer_s(tp, r) if role in _PAIR else 0.0, pp)
                for _, role, degree in members
            )
        )
        shares = _balanced_fluid(times, offsets, total) if fluid else _balanced_int(times, offsets, total)
    else:
        shares = [total / n] * n if fluid else _even(total, n)
    return _make_plan(costs, mode, choice, tp, r, members, shares, total, total, kept, dropped, layout, pp=pp)


def _shrink(costs, tp, r, members, total, fluid, max_shrink, dropped, pp):
    """Every replica keeps its per-step work: the uniform job's share of the live replicas (the dead
    replicas' shares spread over them), a satellite what it computes in a healthy replica's compute
    time; the batch shrinks by the shortfall, at most ``max_shrink`` of it. Where it keeps more
    tokens/s, a partner and its satellite also give up what their transfers take, so that nobody waits
    for the pair (``balance.shrunk_batch_shares`` does the same in training)."""
    n = len(members)
    base = [total / n] * n if fluid else _even(total, n)
    per_h, fixed_h = _pipeline(costs.microbatch_s, 0.0, pp)  # a healthy replica's
    allowed = max_shrink * total

    def plan(absorb: bool) -> Plan:
        shares = list(base)
        cut = []
        for i, (_, role, degree) in enumerate(members):
            o = costs.transfer_s(tp, r) if absorb and role in _PAIR else 0.0
            if role == "satellite" or o:
                per, fixed = _pipeline(costs.microbatch_at(tp, degree), o, pp)
                x = (base[i] * per_h + fixed_h - fixed) / per  # finishes with the healthy replicas
                shares[i] = max(0.0, x) if fluid else max(1, math.floor(x + 1e-9))
                cut.append(i)
        short = sum(base) - sum(shares)
        if short > allowed:
            if fluid:
                for i in cut:
                    shares[i] += (short - allowed) / len(cut)
            else:
                for _ in range(math.ceil(short - allowed - 1e-9)):
                    i = min(cut, key=lambda j: (shares[j] + 1, j))
                    shares[i] += 1
        processed = sum(shares)
        kept = sum(role == "satellite" for _, role, _ in members)
        return _make_plan(
            costs, "ntp shrink", "ntp shrink", tp, r, members, shares, processed, total, kept, dropped, pp=pp
        )

    return max((plan(False), plan(True)), key=lambda p: p.throughput)


def best_plan(
    costs: StepCosts,
    tp: int,
    failed: Sequence[int],
    microbatches: int,
    *,
    fluid: bool = False,
    tp_reduced: int | None = None,
    pp: int = 1,
) -> Plan:
    """The policy: the plan with the most micro-batches per second at the same global batch, among
    dropping the degraded replicas, keeping ``j = 1..min(D, H)`` of them as satellites (balanced
    shares) and running every replica at the reduced degree. Ties go to the plan listed first (drop,
    then fewer satellites). Its ``mode`` is ``"ntp policy"``; ``choice`` and ``kept`` say what it does.
    ``failed``, ``pp``: as in :func:`plan_step`."""
    failed = _check_failed(tp, failed, pp)
    healthy, degraded = _classify(tp, failed)
    same = dict(fluid=fluid, tp_reduced=tp_reduced, pp=pp)
    candidates = []
    for j in range(min(len(degraded), len(healthy)) + 1):
        mode = "drop" if j == 0 else "ntp balanced"
        plan = plan_step(costs, tp, failed, microbatches, mode, keep=j or None, **same)
        if plan is not None:
            candidates.append(plan)
    if degraded:
        candidates.append(plan_step(costs, tp, failed, microbatches, "all at r", **same))
    best = candidates[0]
    for plan in candidates[1:]:
        if plan.throughput > best.throughput * (1 + 1e-12):
            best = plan
    return dataclasses.replace(best, mode="ntp policy")


def predict_retained(
    costs: StepCosts,
    tp: int,
    failed: Sequence[int],
    microbatches: int,
    mode: str = "ntp policy",
    *,
    fluid: bool = False,
    shares: Sequence[float] | None = None,
    keep: int | None = None,
    tp_reduced: int | None = None,
    max_shrink: float = DEFAULT_MAX_SHRINK,
    pp: int = 1,
) -> float | None:
    """Micro-batches per second of :func:`plan_step`'s plan over the uniform job's on all
    ``len(failed)`` replicas (the same global batch, same ``fluid``, same ``pp``); None where the mode
    cannot run (0.0 for drop with no healthy replica left)."""
    plan = plan_step(
        costs,
        tp,
        failed,
        microbatches,
        mode,
        fluid=fluid,
        shares=shares,
        keep=keep,
        tp_reduced=tp_reduced,
        max_shrink=max_shrink,
        pp=pp,
    )
    if plan is None:
        return 0.0 if mode == "drop" else None  # drop: no healthy replica left
    return plan.throughput / uniform_plan(costs, len(tuple(failed)), tp, microbatches, fluid=fluid, pp=pp).throughput


def large_job_table(
    costs: StepCosts,
    dp: int,
    tp: int,
    max_failed: int,
    microbatches: int,
    *,
    max_shrink: float = DEFAULT_MAX_SHRINK,
    sizes: Sequence[int] = (),
    pp: int = 1,
) -> list[dict]:
    """One row per k = 1..``max_failed`` failed GPUs and placement (:data:`PLACEMENTS`,
    :func:`place_failures`) of a job of ``dp`` replicas of ``pp`` stages of ``tp`` GPUs (``N = dp * pp
    * tp``) with global batches of ``microbatches`` micro-batches: the ideal ``(N-k)/N``, every mode's
    retained throughput with integer shares (None where it cannot run), the policy's choice, policy and
    drop with fluid shares and the granularity terms (fluid minus integer), shrink's batch fraction.
    ``sizes``: what must split at the reduced degree (:func:`reduced_degree`; default: nothing, so
    ``r = tp - loss``)."""
    _check_pp(pp)
    rows = []
    for k in range(1, max_failed + 1):
        for placement in PLACEMENTS:
            failed = place_failures(dp, tp, k, placement, pp)
            _, degraded = _classify(tp, failed)
            r = reduced_degree(tp, failed, sizes)
            same = dict(tp_reduced=r, pp=pp)
            policy = best_plan(costs, tp, failed, microbatches, **same)
            shrink = plan_step(costs, tp, failed, microbatches, "ntp shrink", max_shrink=max_shrink, **same)
            balanced = plan_step(costs, tp, failed, microbatches, "ntp balanced", **same)
            drop = plan_step(costs, tp, failed, microbatches, "drop", **same)
            row = dict(
                dp=dp,
                tp=tp,
                pp=pp,
                k=k,
                placement=placement,
                degraded_replicas=len(degraded),
                dead_replicas=sum(f == tp for f in failed),
                tp_reduced=r,
                ideal=(dp * pp * tp - k) / (dp * pp * tp),
                choice=policy.describe(),
                choice_kind=policy.choice,
                slowest_ntp=None if balanced is None else _slowest(costs, balanced),
                slowest_drop=None if drop is None else _slowest(costs, drop),
            )
            for mode in MODES:
                row[mode] = predict_retained(costs, tp, failed, microbatches, mode, max_shrink=max_shrink, **same)
            row["shrink_batch"] = None if shrink is None else shrink.batch_fraction
            for mode in ("ntp policy", "drop"):
                row[mode + " fluid"] = predict_retained(costs, tp, failed, microbatches, mode, fluid=True, **same)
            row["granularity_ntp"] = row["ntp policy fluid"] - row["ntp policy"]
            row["granularity_drop"] = row["drop fluid"] - row["drop"]
            rows.append(row)
    return rows


def _slowest(costs: StepCosts, plan: Plan) -> float:
    """The slowest replica's compute in a healthy stage's micro-batch times (transfers left out): ``(m_d +
    pp - 1) * t_d / t`` with ``t`` a healthy micro-batch's time, the bubble included (``m_d * t_d / t`` at
    ``pp = 1``)."""
    bubble = plan.pp - 1
    return round(
        max((m + bubble) * costs.microbatch_at(plan.tp, t) for m, t in zip(plan.shares, plan.degrees))
        / costs.microbatch_s,
        3,
    )


def verdict(rows: list[dict]) -> list[str]:
    """Lines saying in how many rows the policy keeps degraded replicas, runs every replica at the
    reduced degree or drops them, and for each row where it drops them, why (integer shares: the
    slowest replica's share under NTP and under drop; fluid shares and shrink for comparison)."""

    def label(r):
        pp = f" PP={r['pp']}" if r["pp"] > 1 else ""
        return f"{r['dp']}x{r['tp']}{pp} k={r['k']} {r['placement']}"

    ok = [r for r in rows if r["ntp policy"] >= r["drop"] * (1 - 1e-12)]
    above = [r["ntp policy"] - r["drop"] for r in rows if r["ntp policy"] > r["drop"] * (1 + 1e-12)]
    kinds = {c: sum(r["choice_kind"] == c for r in rows) for c in ("ntp", "all at r", "drop")}
    head = (
        f"NTP policy >= drop in {len(ok)} of {len(rows)} rows (same global batch): it keeps degraded replicas in "
        f"{kinds['ntp']}, runs every replica at TP r in {kinds['all at r']}, drops them in {kinds['drop']}"
    )
    if above:
        head += f"; above drop in {len(above)} rows, by {min(above):+.2%} to {max(above):+.2%}"
    lines = [head]
    for r in rows:
        if r["choice_kind"] != "drop":
            continue
        if r["degraded_replicas"] == 0:
            lines.append(f"  {label(r)}: the failures take out whole replicas: nothing to keep ({r['drop']:.2%})")
            continue
        if r["ntp balanced"] is None:
            ntp = "NTP refused (more degraded replicas than healthy)"
        else:
            ntp = f"balanced NTP {r['ntp balanced']:.2%} (slowest replica {r['slowest_ntp']:g} micro-batch times)"
        shrink = "" if r["ntp shrink"] is None else f"; shrink {r['ntp shrink']:.2%} (batch {r['shrink_batch']:.2%})"
        lines.append(
            f"  {label(r)}: drops: {ntp} vs drop {r['drop']:.2%} ({r['slowest_drop']:g}): integer shares; fluid "
            f"NTP {r['ntp policy fluid']:.2%} vs drop {r['drop fluid']:.2%}{shrink}"
        )
    return lines
