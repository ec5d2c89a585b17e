"""Executes a :class:`~..plan.reshard_plan.ReshardPlan` with batched point-to-point transfers.

Every rank of the plan (trainer and engine ranks in one process group) builds a
:class:`ReshardExecutor` once, from the whole plan or its own
(``build_reshard_plan(rank=)``: the same transfers), and calls
:meth:`~ReshardExecutor.refit` for each weight version. Transfers between one pair of ranks are packed, in plan order,
into buckets of at most ``bucket_bytes`` (a transfer larger than a bucket is
cut into rows); round ``k`` moves the ``k``-th round of every pair at once (one
group launch, :meth:`~..control.peers.Peers.post`), or with the pairs in phases (many peers within a memory budget,
:mod:`..plan.budget`) the rounds of one phase's pairs. Up to ``max_inflight`` rounds are in flight: round
``k + 1`` is posted before round ``k`` is waited on and unpacked. Contiguous
runs of at least ``zero_copy_bytes`` skip the buckets (:mod:`..plan.direct`):
they go from the sender's tensor straight into a streaming receiver's, in
rounds of their own after the pair's buckets and before a last header-only
bucket (an atomic receiver stages them like buckets).

Every bucket starts with a 40-byte header (the sender's version, the wire id the
ranks agreed on, the sender's rank, the bucket index, the NaN/Inf flag). A receiver refuses the
version (:class:`RefitRejected`) if any source serves another version or
another plan. With ``atomic=True`` (default) it writes only after every bucket
has arrived and every header passed, so its tensors keep the previous version;
streaming (``atomic=False``) checks round 0 (a bucket of every source) before
the first write and later rounds at the end; from its first write until it
completes, the rank holds no complete version (:attr:`~ReshardExecutor.version`
is None).

With ``check_finite`` (default) the copies that pack each bucket also look for
NaN / Inf and raise a flag in the bucket's header, so the check reads no byte
twice and the verdict travels with the data: a receiver refuses a bucket that
carries one as it refuses a stale one (``reason="nonfinite"``: an atomic
receiver keeps its version, a streaming one that already wrote a round holds
none), and the sender, once its rounds are done, refuses too, naming the HF
tensor. An atomic rank's local copies are checked before it applies the
version (next to the rounds in flight), a streaming rank's as they run. A rank
whose tensors are not the layout's does not raise when its executor is built: it
reports this at the first refit's agreement, so that every rank refuses at once
(``reason="tensors"``) instead of waiting on it.

This module is the round loop. The staging buffers and copies are
:mod:`.staging`'s (allocated on the first refit and reused; every copy built
once as views, issued as batched copies), the bucket headers :mod:`..plan.wire`'s and
the first refit's agreement :mod:`.agreement`'s. An optional
:class:`RefitGate` runs the engine's logits against the trainer's after the
refit and records the KL in :class:`RefitStats`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import time
from collections import deque
from collections.abc import Callable

import torch

from ... import copy_check
from ...copies import Span
from ...sharding.megatron import megatron_tensors
from ..control.peers import as_peers
from ..engines.gate import RefitGate
from ..plan.budget import (
    MIN_OP_BYTES,
    NO_WORDS,
    PHASES,
    BudgetError,
    StagingPlan,
    buffer_sizes,
    choose_phases,
    keeps_every_round,
    peer_lanes,
    job_slots,
    plan_in_phases,
    rank_words,
    small_pairs,
)
from ..plan.direct import DirectRound, round_nbytes
from ..plan.errors import RefitRejected, RefitStats
from ...nogc import paused_gc
from ..plan.reshard_plan import ReshardPlan, Run, Transfer, fanout_plans
from ..plan.wire import (
    BAD_TENSORS,
    HEADER_BYTES,
    NO_STAGING,
    NONFINITE_WORD,
    PAYLOAD_OFFSET,
    bucket_nbytes,
    header_refusals,
    header_rows,
    wire_id,
)
from .agreement import out_of_memory, settle, tensor_problem
from .staging import Staging

__all__ = [
    "FanoutRefit",
    "HEADER_BYTES",
    "RefitGate",
    "RefitRejected",
    "RefitStats",
    "ReshardExecutor",
    "megatron_tensors",
    "ntp_megatron_tensors",
]

log = logging.getLogger(__name__)


def ntp_megatron_tensors(ddp) -> dict[str, torch.Tensor]:
    """This rank's local tensors for :func:`~megatron_ext.sharding.ntp_megatron_layout`, from a
    ``NonuniformTPDistributedDataParallel``.

    The NTP layout holds each replica at the TP degree it computes at. On a
    degraded replica (``tp_reduced``) those are the parameters of
    ``ddp.compute_module`` (``ddp.module`` is empty there: the optimizer steps
    its healthy partner's). They catch up with the optimizer only when the
    partner sends them, so this first calls ``ddp.refresh_compute_params()`` (a
    no-op unless a step happened since the last transfer; collective over the
    degraded replica and its partner, so call it on every trainer rank). On
    healthy replicas the parameters are the ones the optimizer steps.

    Transfers write in place, so the tensors stay valid across steps, but a degraded
    replica's are stale again after the next optimizer step: build the executor with
    ``refresh=ddp.refresh_compute_params`` so that every refit serves the last step.
    """
    refresh = getattr(ddp, "refresh_compute_params", None)
    if refresh is not None:
        refresh()
    return megatron_tensors(ddp)


def _held(version: int, source_version) -> Callable[[str], int | None]:
    """The version each local tensor holds, from :meth:`ReshardExecutor.refit`'s ``source_version``."""
    if isinstance(source_version, dict):
        return lambda name: source_version.get(name, version)
    return lambda name: version if source_version is None else source_version


def _direct(r) -> bool:
    return isinstance(r, DirectRound)


def _carried(rounds: list, *, whole_first: bool = False) -> dict[int, list[Transfer]]:
    """What the header of each staged bucket of one pair vouches for (by round): its pieces; the pair's first
    and last bucket also its zero-copy transfers; ``whole_first`` (pairs in phases: the first bucket is round
    0's header alone) the first one every transfer of the pair."""
    direct = [t for r in rounds if _direct(r) for t in r.transfers]
    staged = [t for r in rounds if r is not None and not _direct(r) for t, _ in r] if whole_first else []
    out = {}
    for k, r in enumerate(rounds):
        if r is not None and not _direct(r):
            out[k] = [t for t, _ in r] + (direct if k in (0, len(rounds) - 1) else []) + (staged if k == 0 else [])
    return out


class ReshardExecutor:
    """This rank's part of a reshard plan: what it sends, receives and copies locally.

    ``tensors`` maps this rank's local tensor names (the plan's layout names) to
    its tensors: the trainer's parameters (:func:`megatron_tensors`) on source
    ranks, the engine's tensors on destination ranks. A tensor may have more
    rows than the layout keeps (Megatron's padded vocabulary).

    ``refresh``: called at the start of every :meth:`refit`, before anything
    is packed (and counted in its seconds), to bring the source tensors up to
    date: ``ddp.refresh_compute_params`` on the ranks of a nonuniform-TP trainer
    (with :func:`ntp_megatron_tensors`). It is collective over each degraded replica
    and its partner, so give it on every trainer rank.

    ``group``: a ``torch.distributed`` group (None: the default world), whose
    global ranks are the plan's ranks; or a :class:`~..control.refit_group.RefitGroup`
    spanning a trainer job and an engine job, whose refit ranks are (any
    :class:`~..control.peers.Peers`: the executor moves bytes only through it).

    ``max_inflight`` rounds are posted before the oldest is waited on. Staging
    memory (:attr:`staging_bytes`): ``max_inflight`` send buckets per peer, plus
    on receivers the whole version with ``atomic=True`` (nothing is written
    until every bucket arrived and passed its header check) or
    ``max_inflight`` buckets per peer with ``atomic=False`` (each round is
    written as it arrives; the headers of round 0, which carries a bucket of
    every source, are still checked before the first write, later rounds' at
    the end: a source stale only in a later bucket leaves the tensors mixed
    and :attr:`version` None; with the pairs in phases, round 0 is a header alone per
    pair that vouches for all its transfers, so such a source is refused before
    anything is written). ``atomic_staging="host"`` keeps an atomic
    receiver's version in pinned host memory instead (:attr:`staging_host_bytes`):
    it receives through ``max_inflight`` buffers per peer, as a streaming one, and
    applies the version with one host-to-device pass through them.

    ``memory_budget_bytes`` bounds every rank's device staging, whatever its number
    of peers: each pair's bucket shrinks below ``bucket_bytes`` to fit
    (:func:`~..plan.budget.plan_staging`; each rank's slot size, gathered at the first
    refit's agreement, so both ends of a pair cut it alike). A budget
    that cannot hold one row of some tensor per slot, or an atomic receiver's
    version staged on the device, is refused at the agreement (the first refit; a
    refit across jobs when it is built) with :class:`RefitRejected` (``"staging"``)
    on every rank alike, naming the tensor or rank and the least budget that works.
    ``memory_budget_strict=False`` (``--refit-memory-budget-mb auto``) cuts the buckets the
    same way but lets an atomic receiver keep the version on the device on top of it.
    :attr:`staging_plan` says what was chosen (logged at INFO on the first refit).
    When the budget split over many peers would make a pair's bucket smaller than
    ``min_op_bytes`` (NCCL moves small ops far below the link), the job's pairs are
    split into phases (:mod:`~..plan.budget`): a round carries the pairs of one
    phase, so each rank stages buffers for the peers of one phase only, and
    larger ones (a header-only round 0 carries every pair's first header).
    ``min_op_bytes=None``: one phase whatever the buckets. Every rank must give the same.

    ``zero_copy_bytes``: contiguous runs (merged within a pair) of at least this many bytes
    go zero-copy: no send staging, no pack copy; a streaming receiver writes them in place
    once round 0's headers passed (a receiver that refused drains them into one scratch
    buffer of at most a bucket), an atomic one stages them like buckets. With
    ``check_finite`` the sender checks them in chunks of rounds, right after posting a chunk's
    first round (one multi-tensor reduction per dtype: a read, not a copy, next to that round's
    transfer), and raises the flag in the pair's last header. Part of the plan check: both sides must
    agree. None (default): every byte is staged. On 4xH200 within 512 MiB zero-copy
    (:data:`~..plan.direct.ZERO_COPY_MIN_BYTES`) took TP2 -> TP2 from 259 MiB of staging
    per rank to 0.7 MiB at 17.1 vs 15.6 ms, and was faster than staging in the four other
    dense layouts (docs/weight_export_reshard.md).

    The executor keeps views of ``tensors`` from the first refit on: update
    them in place; replacing a tensor object needs a new executor.

    Tensors that are not the layout's (a missing name, another shape or dtype,
    not contiguous) do not raise here: :attr:`problem` says what is wrong, and
    the first :meth:`refit` raises :class:`RefitRejected` (``"tensors"``) on
    every rank of the group, with this message on this rank and quoted on the
    others, so that no peer waits on a rank that cannot send.

    With ``check_finite`` every refit looks for NaN / Inf in the copies that move the
    bytes anyway (:class:`~megatron_ext.copies.CopyBatch` ``check=True``): the packing
    copies flag each bucket's header, receivers refuse flagged buckets
    (``"nonfinite"``) when they check the headers, and a rank that sent or copies a
    NaN or Inf refuses after its rounds, naming the HF tensor and box. No extra read,
    no extra collective; ``check_finite=False`` skips it (every rank must agree: it is
    part of the first refit's plan check).
    """

    @paused_gc()  # (planning: see megatron_ext/nogc.py)
    def __init__(
        self,
        plan: ReshardPlan,
        rank: int,
        tensors: dict[str, torch.Tensor],
        *,
        group=None,
        bucket_bytes: int = 64 << 20,
        atomic: bool = True,
        max_inflight: int = 2,
        refresh: Callable[[], None] | None = None,
        check_finite: bool = True,
        memory_budget_bytes: int | None = None,
        atomic_staging: str = "device",
        memory_budget_strict: bool = True,
        zero_copy_bytes: int | None = None,
        min_op_bytes: int | None = MIN_OP_BYTES,
    ):
        if bucket_bytes <= PAYLOAD_OFFSET:
            raise ValueError(f"bucket_bytes must be > {PAYLOAD_OFFSET} (the aligned bucket header), got {bucket_bytes}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if zero_copy_bytes is not None and (not isinstance(zero_copy_bytes, int) or zero_copy_bytes < 1):
            raise ValueError(f"zero_copy_bytes must be None (stage every byte) or an int >= 1, got {zero_copy_bytes!r}")
        if plan.rank is not None and plan.rank != rank:
            raise ValueError(f"the plan was built for rank {plan.rank} (build_reshard_plan(rank=)), not rank {rank}")
        self.plan, self.rank, self.group = plan, rank, group
        self.peers = as_peers(group)
        self.tensors, self.atomic, self.max_inflight = tensors, atomic, max_inflight
        self.bucket_bytes = bucket_bytes
        self.refresh = refresh
        # why this rank cannot take part (None: it can)
        self.problem: str | None = tensor_problem(plan, rank, tensors, self._who)
        # this rank's transfers, in plan order (a whole plan's or a rank's plan: the same list)
        mine = plan.transfers if plan.rank is not None else [t for t in plan.transfers if rank in (t.src, t.dst)]
        self.transfers = mine
        self.local: list[Transfer] = [t for t in mine if t.src == rank == t.dst]
        self.local_bytes = sum(t.nbytes for t in self.local)
        self._sourced = [t for t in mine if t.src == rank]  # what this rank serves, in plan order
        self.atomic_staging = atomic_staging
        self.check_finite = check_finite
        self._staging_args = dict(
            bucket_bytes=bucket_bytes,
            max_inflight=max_inflight,
            atomic=atomic,
            rank=rank,
            zero_copy_bytes=zero_copy_bytes,
            atomic_staging=atomic_staging,
        )
        self._budget = dict(budget_bytes=memory_budget_bytes, strict=memory_budget_strict)
        self.min_op_bytes = min_op_bytes
        # each rank's words (:func:`~..plan.budget.rank_words`: its pairs' digest, its slot size and count in each
        # number of phases; a pair's bucket is the smaller of its two ranks' slot sizes): a whole plan has every
        # rank's; a rank's plan has its own, and the others' are gathered before the first refit (:meth:`_settle`)
        self._settled = False
        self._pairs_agree = True  # whether the two ends of every pair planned alike (a rank's plan: _settle)
        self._job_ranks = sorted({*plan.src.ranks, *plan.dst.ranks})
        size = dict(bucket_bytes=bucket_bytes, max_inflight=max_inflight, budget_bytes=memory_budget_bytes)
        counted = [rank] if plan.rank is not None else {*self._job_ranks, rank}
        self._shares = {r: NO_WORDS for r in {*self._job_ranks, rank}}
        self._shares.update(rank_words(mine if plan.rank is not None else plan.transfers, counted, **size))
        self.staging_plan: StagingPlan | None = None  # each pair's buckets (a rank's plan: from _settle on)
        self.budget_problem: RefitRejected | None = None  # a budget that cannot hold this rank's staging
        self.send: dict[int, list] = {}
        self.recv: dict[int, list] = {}
        self.rounds = self.sent_bytes = self.received_bytes = 0
        self.phases = 1  # the job's pairs in this many phases (:meth:`_cut`)
        self._lanes: dict[tuple[str, int], int] = {}  # each peer's staging lane, pairs in phases
        self.wire_id: int | None = None
        if plan.rank is None:  # a whole plan: every pair's size and check from it alone, here
            self._cut(plan.transfers)
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        if check_finite:  # the checked copies' kernel compiles while the plan is agreed on (its variant without
            # stores: the check of zero-copy sources and of an atomic rank's local copies' sources)
            check_only = zero_copy_bytes is not None or (atomic and bool(self.local))
            copy_check.prewarm(self.device, {t.dtype for t in tensors.values()}, check_only=check_only)
        self.staging: Staging | None = None  # buffers and copies, from the first refit on
        self._side_stream = None  # atomic ranks' check of their local copies' sources (CUDA)
        self.version: int | None = None  # the version this rank's destination tensors hold (None: none accepted)
        # the first refit's set-up (seconds): settle (every rank's words gathered: with a rank's plan, also the wait
        # for the slowest rank's plan), staging, agreement, start
        self.setup_s: dict[str, float] = {}

    @property
    def _who(self) -> str:
        return f"{self.peers.word} {self.rank}"

    def _settle(self, what: str) -> None:
        """Once, before the first refit's agreement: every rank's words (its pairs' digest, its slot size and count
        in each number of phases), gathered (by every rank, whatever plan it was given, so every rank runs the same
        exchanges). A rank's plan then cuts its pairs (:meth:`_cut`: the phases from every rank's words, a pair's
        bucket the smaller of its two ranks' slots); :meth:`agree` raises
        :class:`RefitRejected` (``"plan"``) on every rank alike when the two ends of some pair planned other
        transfers (their digests do not cancel out) at the agreement, after its checks of tensors and staging.
        A whole plan was cut when it was built."""
        if self._settled:
            return
        got = self.peers.gather_words(list(self._shares[self.rank]), self.device, what=what)
        self._settled = True  # every rank gathered once: a later refit does not gather again
        if self.plan.rank is None:
            return
        self._pairs_agree = functools.reduce(operator.xor, (w[0] for w in got), 0) == 0
        self._shares.update((r, tuple(w)) for r, w in zip(self.peers.ranks(len(got)), got))
        try:
            self._cut(self.transfers)
        except Exception as exc:  # noqa: BLE001 - reported at the agreement, so that no peer waits on this rank
            self.problem = self.problem or f"{self._who}: cannot cut its pairs into buckets: {exc}"

    def _cut(self, transfers: list[Transfer]) -> None:
        """This rank's pairs of ``transfers`` cut into rounds (:func:`~..plan.budget.plan_in_phases`, in the
        phases :func:`~..plan.budget.choose_phases` picks from every rank's words), what each bucket's header
        vouches for, and the wire id (every rank's slot size and pairs' digest, the phases, the zero-copy size and
        the checks)."""
        job = {r: w for r, w in self._shares.items() if r in self._job_ranks or r == self.rank}
        i = choose_phases(job.values(), self.min_op_bytes)
        self.phases = PHASES[i]
        try:
            self.staging_plan = plan_in_phases(transfers, job, i, **self._staging_args, **self._budget)
        except BudgetError as exc:  # reported at the agreement, so that every rank refuses at once
            self.budget_problem = RefitRejected(f"{self._who}: {exc}. Nothing was sent", reason="staging")
            self.staging_plan = plan_in_phases(transfers, job, i, **self._staging_args)
        cut = sorted(self.staging_plan.buckets.items())  # this rank's pairs, cut by the planner
        self.send = {dst: b for (src, dst), b in cut if src == self.rank}
        self.recv = {src: b for (src, dst), b in cut if dst == self.rank}
        self.rounds = max([len(b) for b in (*self.send.values(), *self.recv.values())], default=0)
        self.sent_bytes, self.received_bytes = (
            sum(round_nbytes(b) for bs in table.values() for b in bs if b is not None)
            for table in (self.send, self.recv)
        )  # per refit, on the wire
        self._lanes = peer_lanes(self.rank, self.send, self.recv, self.phases)
        # streaming: the rounds whose zero-copy bytes are written in place, after round 0's headers are checked
        self._in_place = (
            set() if self.atomic else {k for bs in self.recv.values() for k, b in enumerate(bs) if _direct(b)}
        )
        # what each staged bucket's header vouches for: its pieces, and on a pair's first and last bucket its
        # zero-copy transfers (the first one's version is checked before anything is written; the last one
        # carries their NaN/Inf flag)
        self._carried = {
            (side, peer, k): ts
            for side, table in (("send", self.send), ("recv", self.recv))
            for peer, bs in table.items()
            for k, ts in _carried(bs, whole_first=self.phases > 1).items()
        }
        self._send_sources = {
            (p, k): sorted({t.src_run.local for t in ts})
            for (side, p, k), ts in self._carried.items()
            if side == "send"
        }
        slots = job_slots(job, i)
        words = ",".join(f"{r}:{slots[r]}:{w[0]}" for r, w in sorted(job.items()) if r in self._job_ranks)
        self.wire_id = wire_id(
            f"{words};phases={self.phases};small={i == 0 and small_pairs(job.values())}",
            f"zero-copy>={self._staging_args['zero_copy_bytes']}",
            self.check_finite,
        )

    # ------------------------------------------------------------------ staging
    @paused_gc()
    def _allocate(self) -> None:
        """The staging buffers and copies (:class:`~.staging.Staging`), with the NaN/Inf check in the copies
        when ``check_finite``."""
        self.staging = Staging(
            self.send,
            self.recv,
            self.local,
            self._span,
            list(self._send_sources),
            atomic=self.atomic,
            max_inflight=self.max_inflight,
            device=self.device,
            host=self.atomic and self.atomic_staging == "host",
            check=self.check_finite,
            lanes=self._lanes,
        )
        if self.send or self.recv:
            log.info("reshard refit: %s: %s", self._who, self.staging_plan.line(self.rank))

    def _span(self, run: Run) -> Span:
        """``run`` of this rank's tensors, as integers (:class:`~megatron_ext.copies.Span`: the staging's pieces)."""
        t = self.tensors[run.local]
        if not t.is_contiguous():
            raise ValueError(f"{run.local}: a run needs a contiguous tensor, got strides {t.stride()}")
        return Span(t, run.offset, run.count, run.length, run.stride)

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory this rank holds on its device (0 before the first refit)."""
        return 0 if self.staging is None else self.staging.nbytes

    @property
    def staging_host_bytes(self) -> int:
        """Bytes of staging this rank holds in host memory (atomic receivers with ``atomic_staging="host"``)."""
        return 0 if self.staging is None else self.staging.host_nbytes

    # -------------------------------------------------------------------- refit
    def refit(
        self,
        version: int,
        *,
        source_version: int | dict[str, int | None] | None = None,
        verify: RefitGate | None = None,
    ) -> RefitStats:
        """Move this rank's share of one weight version; every rank of ``group`` calls it.

        ``source_version``: the version of the bytes this rank sends (default
        ``version``; a dict maps local tensor names to the version they hold,
        e.g. an engine replica serving a fan-out wave; None: no valid version).
        Raises :class:`RefitRejected` on a receiver that a source serves another
        version or a NaN or Inf (after draining every round, so all ranks stay in
        step) or whose ``verify`` gate fails; on a rank that sent or copies a NaN
        or Inf for this version (after its rounds); on the first refit, on every rank if
        any rank runs another plan or bucket size, cannot allocate its staging
        buffers or has tensors that are not the layout's. A streaming receiver
        holds no complete version (:attr:`version` None) from its first write
        until the refit completes, so a refit that dies midway leaves it None.
        """
        if self.staging is None:
            self._prepare()
        start = time.perf_counter()
        if self.refresh is not None:
            self.refresh()
        self._set_headers(version, source_version)
        self._wrote = False
        refused: list[str] = []
        unchecked: list = []  # rounds whose headers are checked together later (see _complete)
        inflight: deque = deque()
        local_check = None
        direct = self._direct_check()
        try:
            for k in range(self.rounds):
                # a round written in place waits for round 0's headers (checked before anything is written)
                while inflight and (len(inflight) == self.max_inflight or (k in self._in_place and inflight[0][0] < 1)):
                    self._complete(inflight.popleft(), version, refused, unchecked)
                if direct is not None and k in self.staging.trailer_rounds:
                    self._flag_trailers(direct)
                inflight.append(self._post(k, refused))
                if direct is not None and k in self.staging.direct_slices:
                    self._check_direct(direct, k)  # after its round is posted: next to its transfer
                if k == 0:
                    local_check = self._check_local()  # atomic: next to the rounds in flight
            direct_check = torch.cat(direct["flags"]) if direct is not None and direct["flags"] else None
            if not self.rounds:
                local_check = self._check_local()
            self.staging.prepare_apply()  # atomic: built while the rounds are in flight
            while inflight:
                self._complete(inflight.popleft(), version, refused, unchecked)
            if unchecked and not refused:
                if self.staging.host and self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the headers' copies to the host
                refused.extend(header_refusals(unchecked, version, self.wire_id, self._bucket_names))
            if self.check_finite:  # what this rank sent or copies itself: one device-to-host read
                refused.extend(self._own_nonfinite(version, source_version, local_check, direct_check))
        except BaseException:
            for _, reqs, _ in inflight:  # let posted transfers finish or fail before the buffers are reused
                for req in reqs:
                    with contextlib.suppress(Exception):  # the first error is the one raised
                        req.wait()
            raise
        sent, received = self.sent_bytes, self.received_bytes
        stats = RefitStats(
            version, 0.0, sent, received, self.local_bytes, self.rounds, self.max_inflight, self.staging_bytes
        )
        if refused:
            stats.seconds = time.perf_counter() - start
            reason = next(
                (r for r in ("version", "plan", "nonfinite") if any(m.startswith(r) for m in refused)), "nonfinite"
            )
            held = (
                "holds no complete version (the rounds written before the check are mixed)"
                if self._wrote
                else f"kept version {self.version}"
            )  # streaming: version became None at the first write
            raise RefitRejected(
                f"rank {self.rank} refused version {version} and {held}: " + "; ".join(refused[:4]),
                reason=reason,
                stats=stats,
            )
        if self.atomic or not self._wrote:
            self.version = None  # writing: no complete version until the copies below are done
            # atomic: every bucket of this version is here and checked, apply it (local copies too) in one go;
            # streaming with no round received: the local copies are all there is
            if self.atomic:
                self.staging.apply()
            else:
                bad = self.staging.local.run()
                if bad is not None and bad.any():  # streaming: checked as it was written
                    stats.seconds = time.perf_counter() - start
                    raise RefitRejected(
                        f"rank {self.rank} refused version {version} and holds no complete version: "
                        + "; ".join(self._nonfinite_in(bad.tolist(), self.staging.local_groups, "copies")),
                        reason="nonfinite",
                        stats=stats,
                    )
        self.version = version
        stats.seconds = time.perf_counter() - start  # the move and apply; the gate's forward passes not included
        if sent or received or self.local_bytes:
            moved = sent + received + self.local_bytes
            log.info(
                "reshard refit: %s version %d: sent %.2f MB, received %.2f MB, local %.2f MB in %.1f ms "
                "(%.2f GB/s), %d rounds",
                self._who,
                version,
                sent / 1e6,
                received / 1e6,
                self.local_bytes / 1e6,
                stats.seconds * 1e3,
                moved / max(stats.seconds, 1e-9) / 1e9,
                self.rounds,
            )
        if verify is not None and self.rank in self.plan.dst.ranks:
            result = verify(self.plan.dst, self.rank, self.tensors, version)
            stats.kl, stats.max_logit_diff, stats.gate_ok = result.kl, result.max_abs_diff, verify.passes(result)
            if not stats.gate_ok and verify.on_fail == "raise":
                self.version = None
                raise RefitRejected(
                    f"rank {self.rank}: version {version} failed the refit gate: {verify.why(result)}",
                    reason="gate",
                    stats=stats,
                )
        return stats

    def _prepare(self) -> None:
        """First refit: staging buffers and copies, then the agreement (:meth:`agree`), which also
        reports a rank out of memory to all, so that nobody waits on a peer that will not send; then
        the NCCL communicator, which PyTorch wants before the first batch of P2P ops. A rank whose
        tensors are not the layout's (:attr:`problem`) allocates nothing and reports its problem."""
        began = time.perf_counter()
        self._settle("reach the refit")
        failed = self.budget_problem
        start = time.perf_counter()
        if self.problem is None and failed is None:
            try:
                self._allocate()
            except torch.OutOfMemoryError as exc:
                self.staging = None
                keep_all = keeps_every_round(self.atomic, self.atomic_staging)
                need = buffer_sizes(
                    self.send,
                    self.recv,
                    keep_all=keep_all,
                    max_inflight=self.max_inflight,
                    stage_direct=self.atomic,
                    lanes=self._lanes,
                )
                failed = out_of_memory(
                    exc,
                    self._who,
                    need=sum(need.values()),
                    received=self.received_bytes,
                    atomic=self.atomic,
                    max_inflight=self.max_inflight,
                    bucket_bytes=self.bucket_bytes,
                )
        allocated = time.perf_counter()
        try:
            self.agree(own=failed)
        except RefitRejected:
            self.staging = None  # the next refit allocates and agrees again
            raise
        agreed = time.perf_counter()
        self.peers.start()  # every rank arrived
        self.setup_s = dict(
            settle=start - began,
            staging=allocated - start,
            agreement=agreed - allocated,
            start=time.perf_counter() - agreed,
        )
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.setup_s.items())
        log.debug("reshard refit: %s: first refit set-up: %s", self._who, parts)

    def agree(self, *, what: str = "reach the refit", own: RefitRejected | None = None) -> None:
        """One exchange over the group (:mod:`.agreement`): every rank raises :class:`RefitRejected`
        alike if any rank's tensors are not the layout's (``"tensors"``), could not allocate its
        staging (``"staging"``; ``own``: this rank's error) or runs another plan, bucket size or
        checks (``"plan"``). The first refit runs it; a refit across jobs also runs it when it is
        built (``what`` says what the ranks wait to do, in a timeout's message)."""
        self._settle(what)
        own = own or self.budget_problem
        code = BAD_TENSORS if self.problem is not None else NO_STAGING if own is not None else self.wire_id
        got = self.peers.gather_notes(code, self.problem or "", self.device, what=what)
        ranks = self.peers.ranks(len(got))
        settle(
            got,
            ranks,
            who=self._who,
            word=self.peers.word,
            problem=self.problem,
            own=own,
            pairs_agree=self._pairs_agree,
        )

    def _check_local(self):
        """Atomic ranks with ``check_finite``: the sources of their local copies (which run only when the
        version is applied) checked on a side stream next to the rounds in flight; the flags (int32, or None)."""
        if not self.staging.local_sources:
            return None
        side = self._side()
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            return self.staging.local_check.run()

    def _direct_check(self) -> dict | None:
        """With ``check_finite`` and zero-copy transfers to send: this refit's check of them (:meth:`_check_direct`
        adds each round's flags, :meth:`_flag_trailers` raises the pairs' last headers from ``raised``)."""
        if not (self.check_finite and self.staging.direct_sources):
            return None
        raised = torch.zeros(len(self.staging.trailer_rows), dtype=torch.int64, device=self.device)
        return {"flags": [], "raised": raised}

    def _check_direct(self, direct: dict, k: int) -> None:
        """The zero-copy transfers of the chunk of rounds that starts at round ``k`` (read, not copied: no pass
        of their own reads them), checked for NaN / Inf on the current stream right after round ``k`` is
        posted, so the read runs next to that round's transfer and ends before the next round's (which waits
        for the current stream); one flag per source (:attr:`~.staging.Staging.direct_slices`, in chunks of
        :data:`~.staging.CHECK_CHUNK_BYTES`). Nothing here waits for the device."""
        st = self.staging
        start, end = st.direct_slices[k]
        # the copy-check kernel without its stores: a few launches per chunk, where a reduction and its flags
        # cost the host a dozen operations, enough to keep it from posting the next round in time (2xH200, MoE
        # colocated TP1 EP2 -> TP1xDP2: the link idle 1.5 ms before every third round)
        flags = st.direct_check(k).run().to(torch.int64)
        direct["flags"].append(flags)
        direct["raised"].scatter_reduce_(0, st.direct_pairs[start:end], flags, "amax")

    def _flag_trailers(self, direct: dict) -> None:
        """Raise the non-finite word of each pair's last bucket header whose zero-copy transfers, checked so far,
        hold a NaN or Inf (before a round that packs such a bucket; every zero-copy round of a pair comes before
        its last bucket, so its checks are queued by then; on the device, no host sync)."""
        st = self.staging
        st.header_rows[st.trailer_rows, NONFINITE_WORD] = direct["raised"]

    def _side(self):
        """The side stream of the checks that run next to the rounds (CUDA; None elsewhere), after the work
        queued so far."""
        if self.device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._side_stream

    def _own_nonfinite(self, version: int, source_version, local_check, direct_check=None) -> list[str]:
        """Refusals for a NaN or Inf in what this rank sent for ``version`` (the packing copies' flags and its
        zero-copy transfers' check; its receivers refuse the buckets by their headers) or, atomic, in its local
        copies' sources (checked before they are applied; streaming ranks' local copies are checked as they
        run). One device-to-host read."""
        rounds = sorted(k for k in self.staging.pack if self.staging.pack[k].bad.numel())
        parts = [self.staging.pack[k].bad for k in rounds]
        if direct_check is not None:
            parts.insert(0, direct_check.to(torch.int32))
        if self._wrote and not self.atomic and self.staging.local.bad.numel():
            parts.append(self.staging.local.bad)  # streaming: the local copies ran with the first round
        if local_check is not None:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
            parts.append(local_check)
        if not parts:
            return []
        flags = torch.cat(parts).tolist()
        if not any(flags):
            return []  # (below: a piece sent to several receivers is named once)
        held = _held(version, source_version)
        out, at = [], 0
        if direct_check is not None:
            checked = self.staging.direct_checked
            out += [
                f"nonfinite: this rank sent a NaN or Inf in {self._piece(t)}"
                for t, f in zip(checked, flags)
                if f and held(t.src_run.local) == version
            ]
            at = len(checked)
        for k in rounds:
            n = len(self.staging.packed[k])
            out += [
                f"nonfinite: this rank sent a NaN or Inf in {self._piece(t)}"
                for ts, f in zip(self.staging.packed[k], flags[at : at + n])
                if f and ts is not None
                for t in self._which(ts)
                if held(t.src_run.local) == version
            ]
            at += n
        out += self._nonfinite_in(flags[at:], self.staging.local_groups, "copies")
        return list(dict.fromkeys(out))

    def _nonfinite_in(self, flags: list[int], groups: list[tuple[Transfer, ...]], verb: str) -> list[str]:
        return [
            f"nonfinite: this rank {verb} a NaN or Inf in {self._piece(t)}"
            for ts, f in zip(groups, flags)
            if f
            for t in self._which(ts)
        ]

    def _which(self, transfers: tuple[Transfer, ...]) -> tuple[Transfer, ...]:
        """Of the transfers of one flagged copy (several make one copy where they are one range), those whose
        source holds a NaN or Inf, read again (a refusal's message only; all of them if none does any more)."""
        if len(transfers) == 1:
            return transfers
        bad = tuple(t for t in transfers if not bool(torch.isfinite(self._span(t.src_run).view()).all()))
        return bad or transfers

    @staticmethod
    def _piece(t: Transfer) -> str:
        box = ", ".join(f"{a}:{b}" for a, b in t.box.ranges)
        return f"{t.name}[{box}] (its {t.src_run.local})"

    def _bucket_names(self, peer: int, k: int) -> str:
        """The HF tensors bucket ``k`` from ``peer`` vouches for (for a receiver's refusal)."""
        names = list(dict.fromkeys(t.name for t in self._carried[("recv", peer, k)]))
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def _set_headers(self, version: int, source_version) -> None:
        """This refit's header rows, one per send bucket (``self._send_sources`` order), in one copy."""
        if self._send_sources:
            rows = header_rows(self._send_sources, _held(version, source_version), version, self.wire_id, self.rank)
            self.staging.header_rows.copy_(torch.tensor(rows, dtype=torch.int64))

    def _post(self, k: int, refused: list[str]):
        """Post round ``k``: pack its buckets, then one batch of every peer's sends and receives (zero-copy
        ones from and into the tensors; a streaming receiver that refused drains them into scratch)."""
        ops, arrived = [], []
        st = self.staging
        st.prepare(k)  # (the first refit: the copies of round k's chunk of rounds, while earlier rounds are in flight)
        if k in st.pack:
            st.pack[k].run()  # every peer's header and pieces of this round: batched copies
        for kind, table in (("send", self.send), ("recv", self.recv)):
            for peer, buckets in table.items():
                if k < len(buckets) and buckets[k] is not None and not _direct(buckets[k]):
                    n, buf = bucket_nbytes(buckets[k]), st.buf(kind, peer, k)
                    ops.append((kind, buf[:n], peer))
                    if kind == "recv":
                        arrived.append((peer, buf, True))
        ops += [("send", t, peer) for peer, t in st.direct_send.get(k, ())]
        for peer, t in st.direct_recv.get(k, ()):
            drain = refused and k in self._in_place
            ops.append(("recv", st.scratch(t) if drain else t, peer))
        if self.atomic and k in st.direct_recv:  # staged: kept (host) or applied with the version
            peers = dict.fromkeys(p for p, _ in st.direct_recv[k])
            arrived += [(peer, st.buf("recv", peer, k), False) for peer in peers]
        return k, self.peers.post(ops) if ops else [], arrived

    def _complete(self, posted, version: int, refused: list[str], unchecked: list) -> None:
        k, reqs, arrived = posted
        for req in reqs:
            req.wait()
        if not arrived or refused:
            return  # after a refusal: drain the remaining rounds, write nothing more
        if self.atomic and self.staging.host:  # each round to its host buffer; headers read there at the end
            for peer, _, header in arrived:
                held = self.staging.keep(k, peer)
                if header:
                    unchecked.append((k, peer, held[:HEADER_BYTES].view(torch.int64)))
            return
        headers = [(k, peer, buf[:HEADER_BYTES].view(torch.int64)) for peer, buf, header in arrived if header]
        if self.atomic:
            # Nothing is written before the last round, so the headers are checked then, all at
            # once (each bucket keeps its own buffer): reading them here would stall the host on every round.
            unchecked.extend(headers)
            return
        if not self._wrote:
            # Streaming: the first round that arrives carries a bucket of every source (round 0),
            # so its headers are checked before anything is written; later rounds are written as
            # they arrive and checked at the end (a bad one then leaves the tensors mixed: version None).
            refused.extend(header_refusals(headers, version, self.wire_id, self._bucket_names))
            if refused:
                return
            self.version = None  # from the first write until the refit completes: no complete version
            self.staging.local.run()
        else:
            unchecked.extend((k, peer, self.staging.seen[(peer, k)]) for peer, _, _ in arrived)
        self.staging.unpack[k].run()
        self._wrote = True


class FanoutRefit:
    """Updates engine replicas in waves (:func:`~..plan.reshard_plan.fanout_plans`):
    replicas updated in one wave serve the next. Every rank of the job calls
    :meth:`refit` and runs every wave, even after a refusal, so no rank waits
    on another forever. A replica serves the version it holds (the bucket
    headers say which), so a replica that was refused or failed its gate
    causes its own receivers to refuse rather than spread a wrong version;
    :meth:`refit` raises :class:`RefitRejected` at the end on such ranks.
    The other keyword arguments (``group``, ``bucket_bytes``, ``atomic``,
    ``max_inflight``, ``refresh``, ``check_finite``) are given to every wave's
    :class:`ReshardExecutor`."""

    def __init__(
        self, src, dst, replicas: list[list[int]], rank: int, tensors: dict[str, torch.Tensor], *, first_wave=1, **kw
    ):
        self.plans = fanout_plans(src, dst, replicas, first_wave=first_wave)
        self.rank = rank
        self._engine_locals = tuple(dst.tensors.get(rank, {}))
        self.waves = [ReshardExecutor(p, rank, tensors, **kw) for p in self.plans]
        self.version: int | None = None

    def refit(self, version: int, *, verify: RefitGate | None = None) -> list[RefitStats]:
        stats, error = [], None
        for ex in self.waves:
            held = {n: self.version for n in self._engine_locals}  # trainer tensors hold `version`
            try:
                s = ex.refit(version, source_version=held, verify=verify)
            except RefitRejected as e:
                error = error or e
                s = e.stats
                if self.rank in ex.plan.dst.ranks and e.reason == "gate":
                    self.version = None
            else:
                if self.rank in ex.plan.dst.ranks:
                    self.version = version
            stats.append(s)
        if error is not None:
            error.wave_stats = stats
            raise error
        return stats
