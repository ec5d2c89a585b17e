"""Executes a :class:`~.reshard_plan.ReshardPlan` with batched point-to-point transfers.

Every rank of the plan (trainer and engine ranks in one process group) builds a
:class:`ReshardExecutor` once and calls :meth:`~ReshardExecutor.refit` for each
weight version. Transfers between one pair of ranks are packed, in plan order,
into buckets of at most ``bucket_bytes`` (a transfer larger than a bucket is
cut into rows); round ``k`` moves the ``k``-th bucket of every pair at once (one
``batch_isend_irecv``). Up to ``max_inflight`` rounds are in flight: round
``k + 1`` is posted before round ``k`` is waited on and unpacked.

Every bucket starts with a 32-byte header (the sender's version, the plan's
fingerprint, the sender's rank, the bucket index). A receiver refuses the
version (:class:`RefitRejected`) if any source serves another version or
another plan. With ``atomic=True`` (default) it writes only after every bucket
has arrived and every header passed, so its tensors keep the previous version;
streaming (``atomic=False``) checks round 0 (a bucket of every source) before
the first write and later rounds at the end; from its first write until it
completes, the rank holds no complete version (:attr:`~ReshardExecutor.version`
is None).

Before a byte moves, every refit checks, with one fused reduction, that the
tensors each source serves are finite, and one all-reduce tells every rank: a
version with a NaN or Inf is refused everywhere (``reason="nonfinite"``). A rank
whose tensors are not the layout's does not raise when its executor is built: it
reports this at the first refit's agreement, so that every rank refuses at once
(``reason="tensors"``) instead of waiting on it.

Staging buffers are allocated on the first refit and reused, and every copy
(pack, unpack, local) is built once then as views, issued as batched copies
(:class:`~megatron_ext.copies.CopyBatch`). An optional
:class:`RefitGate` runs the engine's logits against the trainer's after the
refit and records the KL in :class:`RefitStats`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from .errors import RefitRejected
from ..sharding.megatron import megatron_tensors
from ..copies import CopyBatch, finite_flags
from .peers import as_peers
from .reshard_plan import ReshardPlan, Run, Transfer, fanout_plans, run_view
from .gate import RefitGate
from .wire import BAD_TENSORS, HEADER_BYTES, NO_STAGING, NO_VERSION, PAYLOAD_OFFSET, bucket_nbytes, bucketize, wire_id

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
    healthy replica (``tp_base``) those are the compute parameters
    (``ddp.compute_module``), not ``ddp.module`` / ``ddp.named_parameters()``:
    that is the training shadow in the ``tp_reduced`` layout (empty on spare
    ranks), which the optimizer steps. The compute parameters catch up with the
    optimizer only when the shadow is unfolded into them, so this first calls
    ``ddp.refresh_compute_params()`` (a no-op unless a step happened since the
    last unfold; collective over the healthy TP group, so call it on every
    trainer rank). On degraded replicas the parameters are the model's own and
    the refresh does nothing.

    Unfolds write in place, so the tensors stay valid across steps, but they are
    stale again after the next optimizer step: build the executor with
    ``refresh=ddp.refresh_compute_params`` so that every refit serves the last step.
    """
    refresh = getattr(ddp, "refresh_compute_params", None)
    if refresh is not None:
        refresh()
    return megatron_tensors(ddp)


@dataclasses.dataclass
class RefitStats:
    """One rank's refit. Byte counts are on the wire (headers and alignment included);
    ``staging_bytes`` is the staging memory this rank holds; ``kl`` /
    ``max_logit_diff`` / ``gate_ok`` are set when a :class:`RefitGate` ran."""

    version: int
    seconds: float
    sent_bytes: int
    received_bytes: int
    local_bytes: int
    rounds: int
    max_inflight: int = 1
    staging_bytes: int = 0
    kl: float | None = None
    max_logit_diff: float | None = None
    gate_ok: bool | None = None


def _held(version: int, source_version) -> Callable[[str], int | None]:
    """The version each local tensor holds, from :meth:`ReshardExecutor.refit`'s ``source_version``."""
    if isinstance(source_version, dict):
        return lambda name: source_version.get(name, version)
    return lambda name: version if source_version is None else source_version


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two run views of one box in the same shape, still views (never a copy: the copies are
    built once and must see later in-place updates). A strided run is ``(rows, length)``; a
    contiguous one ``(1, n)`` takes the other's shape."""
    if a.shape == b.shape:
        return a, b
    if a.shape[0] == 1:
        return a.view(b.shape), b
    if b.shape[0] == 1:
        return a, b.view(a.shape)
    raise ValueError(f"runs of one box with shapes {tuple(a.shape)} and {tuple(b.shape)}")


class ReshardExecutor:
    """This rank's part of a reshard plan: what it sends, receives and copies locally.

    ``tensors`` maps this rank's local tensor names (the plan's layout names) to
    its tensors: the trainer's parameters (:func:`megatron_tensors`) on source
    ranks, the engine's tensors on destination ranks. A tensor may have more
    rows than the layout keeps (Megatron's padded vocabulary).

    ``refresh``: called at the start of every :meth:`refit`, before anything
    is packed (and counted in its seconds), to bring the source tensors up to
    date: ``ddp.refresh_compute_params`` on the ranks of a nonuniform-TP trainer
    (with :func:`ntp_megatron_tensors`). It is collective over the trainer's TP
    group, so give it on every trainer rank.

    ``group``: a ``torch.distributed`` group (None: the default world), whose
    global ranks are the plan's ranks; or a :class:`~.refit_group.RefitGroup`
    spanning a trainer job and an engine job, whose refit ranks are (any
    :class:`~.peers.Peers`: the executor moves bytes only through it).

    ``max_inflight`` rounds are posted before the oldest is waited on. Staging
    memory (:attr:`staging_bytes`): ``max_inflight`` send buckets per peer, plus
    on receivers the whole version with ``atomic=True`` (nothing is written
    until every bucket arrived and passed its header check) or
    ``max_inflight`` buckets per peer with ``atomic=False`` (each round is
    written as it arrives; the headers of round 0, which carries a bucket of
    every source, are still checked before the first write, later rounds' at
    the end: a source stale only in a later bucket leaves the tensors mixed
    and :attr:`version` None).

    The executor keeps views of ``tensors`` from the first refit on: update
    them in place; replacing a tensor object needs a new executor.

    Tensors that are not the layout's (a missing name, another shape or dtype,
    not contiguous) do not raise here: :attr:`problem` says what is wrong, and
    the first :meth:`refit` raises :class:`RefitRejected` (``"tensors"``) on
    every rank of the group, with this message on this rank and quoted on the
    others, so that no peer waits on a rank that cannot send.

    Every refit checks the tensors this rank serves for the version (the rows
    of its source tensors that the layout keeps) for NaN / Inf with one fused
    reduction per dtype, before anything is packed; one all-reduce over the
    group then tells every rank. A non-finite version is refused on every rank
    (``"nonfinite"``) before a byte moves. That costs one read of the served
    tensors, one small all-reduce and one device-to-host read per refit;
    ``check_finite=False`` skips it (every rank must agree: it is part of the
    first refit's plan check).
    """

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
    ):
        if bucket_bytes <= PAYLOAD_OFFSET:
            raise ValueError(f"bucket_bytes must be > {PAYLOAD_OFFSET} (the aligned bucket header), got {bucket_bytes}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.plan, self.rank, self.group = plan, rank, group
        self.peers = as_peers(group)
        self.tensors, self.atomic, self.max_inflight = tensors, atomic, max_inflight
        self.bucket_bytes = bucket_bytes
        self.refresh = refresh
        self.problem: str | None = self._check_tensors()  # why this rank cannot take part (None: it can)
        out, inc = defaultdict(list), defaultdict(list)
        self.local: list[Transfer] = []
        for t in plan.transfers:
            if t.src == rank and t.dst == rank:
                self.local.append(t)
            elif t.src == rank:
                out[t.dst].append(t)
            elif t.dst == rank:
                inc[t.src].append(t)
        self.local_bytes = sum(t.nbytes for t in self.local)
        self.send = {p: bucketize(ts, bucket_bytes) for p, ts in sorted(out.items())}
        self.recv = {p: bucketize(ts, bucket_bytes) for p, ts in sorted(inc.items())}
        self.rounds = max([len(b) for b in (*self.send.values(), *self.recv.values())], default=0)
        self.sent_bytes, self.received_bytes = (
            sum(bucket_nbytes(b) for bs in table.values() for b in bs) for table in (self.send, self.recv)
        )  # per refit, on the wire
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self._sourced = [t for t in plan.transfers if t.src == rank]  # what this rank serves, in plan order
        # what every header of this plan carries: the plan and the bucket size both sides cut it with
        self.check_finite = check_finite
        self.wire_id = wire_id(plan.fingerprint, bucket_bytes, check_finite)
        self._send_sources = {
            (p, k): sorted({t.src_run.local for t, _ in b}) for p, bs in self.send.items() for k, b in enumerate(bs)
        }
        self._header_index = {key: i for i, key in enumerate(self._send_sources)}
        self._bufs: dict[tuple[str, int, int], torch.Tensor] | None = None  # (send|recv, peer, slot) -> buffer
        self.version: int | None = None  # the version this rank's destination tensors hold (None: none accepted)

    @property
    def _who(self) -> str:
        return f"{self.peers.word} {self.rank}"

    def _check_tensors(self) -> str | None:
        """What is wrong with this rank's tensors for the plan (the first problem), or None."""
        for layout in (self.plan.src, self.plan.dst):
            for name, lt in layout.tensors.get(self.rank, {}).items():
                t = self.tensors.get(name)
                if t is None:
                    return (
                        f"{self._who}: the plan needs local tensor {name!r} ({layout.description}); "
                        "pass it in `tensors`"
                        + (" (a nonuniform-TP trainer: ntp_megatron_tensors(ddp))" if layout is self.plan.src else "")
                    )
                if tuple(t.shape[1:]) != lt.shape[1:] or t.shape[0] < lt.shape[0] or t.dtype != lt.dtype:
                    return (
                        f"{self._who}: {name} is {tuple(t.shape)} {t.dtype}, the layout keeps {lt.shape} "
                        f"{lt.dtype}; build the layout from this model's config (a nonuniform-TP trainer: "
                        "pass ntp_megatron_tensors(ddp), not the training shadow)"
                    )
                if not t.is_contiguous():
                    return f"{self._who}: {name} must be contiguous"
        return None

    def tensors_rejected(self, bad: list[tuple[int, str]]) -> RefitRejected:
        """The error every rank raises when ranks ``bad`` (``(rank, problem)``) cannot take part: a rank in
        ``bad`` gives its own problem, the others name the ranks and quote the first problems."""
        if self.problem is not None:
            return RefitRejected(
                f"{self.problem}. Every rank of the refit refused it; nothing was sent", reason="tensors"
            )
        return RefitRejected(
            f"{self._who}: {self.peers.word}s {[r for r, _ in bad]} cannot take part in the refit, nothing "
            "was sent: " + " | ".join(n for _, n in bad[:2]),
            reason="tensors",
        )

    # ------------------------------------------------------------------ staging
    def _key(self, kind: str, peer: int, k: int) -> tuple[str, int, int]:
        """The staging buffer of round ``k`` with ``peer``: atomic receivers keep every round."""
        return kind, peer, k if (kind == "recv" and self.atomic) else k % self.max_inflight

    def _staging_sizes(self) -> dict[tuple[str, int, int], int]:
        """Bytes of each staging buffer, by ``(send|recv, peer, slot)``."""
        sizes: dict[tuple[str, int, int], int] = {}
        for kind, table in (("send", self.send), ("recv", self.recv)):
            for peer, buckets in table.items():
                for k, bucket in enumerate(buckets):
                    key = self._key(kind, peer, k)
                    sizes[key] = max(sizes.get(key, 0), bucket_nbytes(bucket))
        return sizes

    def _allocate(self) -> None:
        """Every staging buffer, sized once: one per (send|recv, peer, slot)."""
        self._bufs = {
            key: torch.empty(n, dtype=torch.uint8, device=self.device) for key, n in self._staging_sizes().items()
        }
        self._build_copies()

    def _view(self, run: Run) -> torch.Tensor:
        return run_view(self.tensors[run.local], run)

    def _build_copies(self) -> None:
        """Every copy of a refit as ``(dst, src)`` views, built once: buffers and tensors are
        fixed, so a refit issues batched copies without rebuilding hundreds of views."""
        self._header_rows = torch.zeros((len(self._send_sources), 4), dtype=torch.int64, device=self.device)
        pack: dict[int, list] = defaultdict(list)  # round -> every peer's header and pieces
        for peer, buckets in self.send.items():
            for k, bucket in enumerate(buckets):
                buf = self._bufs[self._key("send", peer, k)]
                pack[k].append((buf[:HEADER_BYTES].view(torch.int64), self._header_rows[self._header_index[(peer, k)]]))
                for t, off in bucket:
                    src = self._view(t.src_run)
                    pack[k].append((buf[off : off + t.nbytes].view(src.dtype).view(src.shape), src))
        self._pack = {k: CopyBatch(pairs) for k, pairs in pack.items()}
        # Streaming receivers reuse a buffer max_inflight rounds later, so each unpack also keeps the
        # bucket's header in a row of its own, to be checked after the last round.
        keys = [(peer, k) for peer, buckets in self.recv.items() for k in range(len(buckets))]
        self._seen_rows = torch.zeros((len(keys), 4), dtype=torch.int64, device=self.device)
        self._seen = {key: self._seen_rows[i] for i, key in enumerate(keys)}
        unpack: dict[int, list] = defaultdict(list)  # round -> every peer's pieces
        for peer, buckets in self.recv.items():
            for k, bucket in enumerate(buckets):
                buf = self._bufs[self._key("recv", peer, k)]
                if not self.atomic:
                    unpack[k].append((self._seen[(peer, k)], buf[:HEADER_BYTES].view(torch.int64)))
                for t, off in bucket:
                    dst = self._view(t.dst_run)
                    unpack[k].append((dst, buf[off : off + t.nbytes].view(dst.dtype).view(dst.shape)))
        local = [_same_shape(self._view(t.dst_run), self._view(t.src_run)) for t in self.local]
        self._local_copies = CopyBatch(local)
        # the rows of each source tensor served that the layout keeps (padded vocabulary rows excluded);
        # FP8 values are checked through their float32 block scales (a NaN or Inf makes its block's scale one)
        served = {t.src_run.local for t in self._sourced}
        self._finite_views = {
            n: self.tensors[n][: lt.shape[0]]
            for n, lt in self.plan.src.tensors.get(self.rank, {}).items()
            if n in served and self.tensors[n].is_floating_point() and self.tensors[n].dtype.itemsize > 1
        }
        if self.atomic:  # the whole version at once, after the last round's headers are checked
            self._apply = CopyBatch([pair for k in sorted(unpack) for pair in unpack[k]] + local)
        else:
            self._unpack = {k: CopyBatch(pairs) for k, pairs in unpack.items()}

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory this rank holds (0 before the first refit)."""
        return sum(b.numel() for b in (self._bufs or {}).values())

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
        version (after draining every round, so all ranks stay in step) or whose
        ``verify`` gate fails; on every rank, before a byte moves, if a source
        serves a NaN or Inf for this version; on the first refit, on every rank if
        any rank runs another plan or bucket size, cannot allocate its staging
        buffers or has tensors that are not the layout's. A streaming receiver
        holds no complete version (:attr:`version` None) from its first write
        until the refit completes, so a refit that dies midway leaves it None.
        """
        if self._bufs is None:
            self._prepare()
        start = time.perf_counter()
        if self.refresh is not None:
            self.refresh()
        if self.check_finite:
            self._check_finite(version, source_version, start)
        self._set_headers(version, source_version)
        self._wrote = False
        refused: list[str] = []
        unchecked: list = []  # rounds whose headers are checked together later (see _complete)
        inflight: deque = deque()
        try:
            for k in range(self.rounds):
                if len(inflight) == self.max_inflight:
                    self._complete(inflight.popleft(), version, refused, unchecked)
                inflight.append(self._post(k))
            while inflight:
                self._complete(inflight.popleft(), version, refused, unchecked)
            if unchecked and not refused:
                self._check_headers(unchecked, version, refused)
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
            reason = "version" if any(m.startswith("version") for m in refused) else "plan"
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
            (self._apply if self.atomic else self._local_copies).run()
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
        """First refit: staging buffers and copies, then one collective over the group that compares
        every rank's plan and bucket size (buckets cut another way would not match on the wire) and
        reports a rank out of memory to all, so that nobody waits on a peer that will not send. It
        also creates the NCCL communicator, which PyTorch wants before the first batch of P2P ops.
        A rank whose tensors are not the layout's (:attr:`problem`) allocates nothing and takes part
        with a status code and its problem, which every rank then raises."""
        failed = None
        if self.problem is None:
            try:
                self._allocate()
            except torch.OutOfMemoryError as exc:
                self._bufs = None
                failed = exc
        code = BAD_TENSORS if self.problem is not None else NO_STAGING if failed else self.wire_id
        got = self.peers.gather_notes(code, self.problem or "", self.device, what="reach the refit")
        self.peers.start()  # every rank arrived
        ids = dict(zip(self.peers.ranks(len(got)), (v for v, _ in got)))  # rank -> its code
        try:
            bad = [(r, note) for r, (v, note) in zip(ids, got) if v == BAD_TENSORS]
            if bad:
                raise self.tensors_rejected(bad)
            self._check_staging(ids, failed)
            self._check_same_plan(ids)
        except RefitRejected:
            self._bufs = None  # the next refit allocates and checks again
            raise

    def _check_staging(self, ids: dict[int, int], failed: BaseException | None) -> None:
        """Every rank raises :class:`RefitRejected` (``"staging"``) if a rank could not
        allocate its staging buffers; that rank's message says how to need less."""
        if failed is not None:
            need = sum(self._staging_sizes().values())
            received = self.received_bytes
            raise RefitRejected(
                f"rank {self.rank}: out of device memory for {need / 2**30:.2f} GiB of reshard staging buffers "
                + (
                    f"(atomic=True stages the whole version this rank receives, {received / 2**30:.2f} GiB; "
                    "atomic=False stages max_inflight buckets per peer instead)"
                    if self.atomic and received
                    else f"(max_inflight={self.max_inflight} buckets of up to "
                    f"{self.bucket_bytes / 2**20:g} MiB per peer)"
                )
                + "; lower bucket_bytes or max_inflight, or free memory before the refit. Nothing was sent.",
                reason="staging",
            ) from failed
        if NO_STAGING in ids.values():
            raise RefitRejected(
                f"rank {self.rank}: ranks {[r for r, v in ids.items() if v == NO_STAGING]} "
                "ran out of memory for their staging buffers (their errors say how much); nothing "
                "was sent",
                reason="staging",
            )

    def _check_same_plan(self, ids: dict[int, int]) -> None:
        """Every rank raises :class:`RefitRejected` (``"plan"``) if any rank of the group runs
        another plan or bucket size, naming the ranks that differ from the most common one."""
        values = list(ids.values())
        if len(set(values)) == 1:
            return
        common = max(set(values), key=lambda v: (values.count(v), -values.index(v)))
        raise RefitRejected(
            f"rank {self.rank}: ranks {[r for r, v in ids.items() if v != common]} run another reshard plan or "
            f"bucket_bytes than ranks {[r for r, v in ids.items() if v == common]}; nothing was sent. Build "
            "the same layouts (specs, TP/PP/DP/EP, ranks, vocab padding) and the same bucket_bytes "
            "on every rank",
            reason="plan",
        )

    def _check_finite(self, version: int, source_version, start: float) -> None:
        """Every rank raises :class:`RefitRejected` (``"nonfinite"``) before a byte moves if any source
        serves a NaN or Inf for ``version``. Fast path: one max-abs reduction per dtype over the rows of
        this rank's source tensors that the layout keeps (NaN and Inf survive a max), kept on the device,
        and one all-reduce of the flag over the group: one device-to-host read. Slow path, only when
        some rank is flagged: each flagged rank looks, in plan order, for the first transfer it really
        sends or copies with a non-finite value, and every rank learns the HF names (one gather)."""
        # a tensor that holds another version is refused by its receivers for that, and is not checked
        serving = [n for n in self._finite_views if _held(version, source_version)(n) == version]
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        for _, flags in finite_flags([self._finite_views[n] for n in serving]):
            flag |= (~flags).any().to(torch.int64)
        if not self.peers.sum(flag):
            return
        note = self._first_nonfinite(set(serving)) if flag.item() else ""
        got = self.peers.gather_notes(0, note, self.device, what=f"check version {version} for NaN/Inf")
        bad = [(r, n) for r, (_, n) in zip(self.peers.ranks(len(got)), got) if n]
        if not bad:
            return  # the NaN / Inf lie in rows that no rank sends (another replica serves them)
        stats = RefitStats(
            version, time.perf_counter() - start, 0, 0, 0, self.rounds, self.max_inflight, self.staging_bytes
        )
        if note:
            raise RefitRejected(
                f"{self._who}: version {version} has a NaN or Inf in {note}; refused on every rank "
                "before a byte moved (the engines keep the version they hold). Fix the training "
                "step (loss scale, learning rate, data) and refit again",
                reason="nonfinite",
                stats=stats,
            )
        held = f"; this rank keeps version {self.version}" if self.rank in self.plan.dst.ranks else ""
        raise RefitRejected(
            f"{self._who}: refused version {version} before a byte moved: "
            + "; ".join(f"{self.peers.word} {r} serves a NaN or Inf in {n}" for r, n in bad[:4])
            + held,
            reason="nonfinite",
            stats=stats,
        )

    def _first_nonfinite(self, serving: set[str]) -> str:
        """The HF name of the first tensor this rank sends or copies for the version with a NaN or Inf
        (exact runs, plan order), or ""."""
        for t in self._sourced:
            if t.src_run.local in serving and not bool(torch.isfinite(self._view(t.src_run)).all()):
                box = ", ".join(f"{a}:{b}" for a, b in t.box.ranges)
                return f"{t.name}[{box}] (this rank's {t.src_run.local})"
        return ""

    def _set_headers(self, version: int, source_version) -> None:
        """This refit's header rows, one per send bucket (``self._send_sources`` order), in one copy."""
        if not self._send_sources:
            return
        holds, rows = _held(version, source_version), []
        for (_peer, k), locals_ in self._send_sources.items():
            vs = {holds(n) for n in locals_}
            v = version if vs == {version} else next(iter(vs - {version}))
            rows.append([NO_VERSION if v is None else v, self.wire_id, self.rank, k])
        self._header_rows.copy_(torch.tensor(rows, dtype=torch.int64))

    def _post(self, k: int):
        ops, arrived = [], []
        if k in self._pack:
            self._pack[k].run()  # every peer's header and pieces of this round: batched copies
        for kind, table in (("send", self.send), ("recv", self.recv)):
            for peer, buckets in table.items():
                if k < len(buckets):
                    n, buf = bucket_nbytes(buckets[k]), self._bufs[self._key(kind, peer, k)]
                    ops.append((kind, buf[:n], peer))
                    if kind == "recv":
                        arrived.append((peer, buf))
        return k, self.peers.post(ops) if ops else [], arrived

    def _complete(self, posted, version: int, refused: list[str], unchecked: list) -> None:
        k, reqs, arrived = posted
        for req in reqs:
            req.wait()
        if not arrived or refused:
            return  # after a refusal: drain the remaining rounds, write nothing more
        headers = [(k, peer, buf[:HEADER_BYTES].view(torch.int64)) for peer, buf in arrived]
        if self.atomic:
            # Nothing is written before the last round, so the headers are checked then, all at
            # once (each bucket keeps its own buffer): reading them here would stall the host on every round.
            unchecked.extend(headers)
            return
        if not self._wrote:
            # Streaming: the first round that arrives carries a bucket of every source (round 0),
            # so its headers are checked before anything is written; later rounds are written as
            # they arrive and checked at the end (a bad one then leaves the tensors mixed: version None).
            self._check_headers(headers, version, refused)
            if refused:
                return
            self.version = None  # from the first write until the refit completes: no complete version
            self._local_copies.run()
        else:
            unchecked.extend((k, peer, self._seen[(peer, k)]) for peer, _ in arrived)
        self._unpack[k].run()
        self._wrote = True

    def _check_headers(self, headers: list, version: int, refused: list[str]) -> None:
        """Append to ``refused`` every source whose header (``(k, peer, header)`` entries)
        says it serves another version or plan; one device-to-host read for all of them."""
        got = torch.stack([h for _, _, h in headers]).tolist()
        for (k, peer, _), (v, wire, sender, index) in zip(headers, got):
            if v != version:
                held = "no valid version" if v == NO_VERSION else f"version {v}"
                refused.append(f"version: rank {peer} serves {held}")
            elif (wire, sender, index) != (self.wire_id, peer, k):
                refused.append(f"plan: rank {peer} runs another plan or bucket size (bucket {k})")


class FanoutRefit:
    """Updates engine replicas in waves (:func:`~.reshard_plan.fanout_plans`):
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
