"""Moving bucket bytes from the exporting trainer rank to receivers.

Senders (trainer side) share one protocol::

    sender.allocate(nbytes, device)      # the export buffers (IPC shares them)
    sender.start(plan, buffers, version) # plan sent and checked once per layout
    handle = sender.send(bucket, buf)    # handle.wait(): buf may be reused
    sender.finish(version) -> [the version each receiver holds after it]
    sender.abort(version)                # the version will not complete (same answer)

- :class:`InProcessSender`: a :class:`WeightReceiver` in the same process.
- :class:`BroadcastSender`: one ``broadcast`` per bucket over a process group
  that only the trainer's export rank and the engine ranks join (NCCL on GPUs,
  gloo on CPU). Metadata goes once over the control connection; then only bytes.
- :class:`IpcSender` (CUDA): an engine on the same GPU maps the two export
  buffers through CUDA IPC handles sent once per buffer, and acknowledges each
  bucket before its buffer is reused.
- :class:`IpcDirectSender` (CUDA, TP=PP=EP=1 trainers): no export buffers; the
  engine maps the trainer's parameter storage (one handle per storage, sent
  with the plan) and copies each HF tensor straight out of it: one copy per
  refit instead of two.
- :class:`IpcPushSender` (CUDA): the engine shares its weights' storage and the
  trainer's gather writes into them.

The control connection (:mod:`.control`: authenticated JSON frames, never
pickles) carries the plan, version begin/end/abort (each answered with the
version the engine holds, :mod:`.versions`), per-bucket IPC notices and the
verifier's tokens and logits; tensors never travel on
it. A receiver that dies closes it, so the trainer fails at once with
:class:`ReceiverError`; one that hangs fails it after ``timeout_s``.
:func:`serve` is the matching engine-side loop; by default it stages a whole
version and applies it at the end, so a trainer that dies mid-refit leaves the
engine's previous version in place.
"""

from __future__ import annotations

import logging
import secrets

import torch

from ..copies import CopyBatch
from .errors import ReceiverError
from . import control, versions
from .control import ControlError
from .plan import BucketMeta, ExportPlan, PlanMismatch
from .receiver import WeightReceiver
from .refit_group import make_group
from .store import ControlStore, host_store
from .reshard_plan import run_view

__all__ = [
    "SENDERS",
    "BroadcastSender",
    "InProcessSender",
    "IpcDirectSender",
    "IpcPushSender",
    "IpcSender",
    "ReceiverError",
    "make_sender",
    "push_targets",
    "serve",
]

log = logging.getLogger(__name__)
_ABORT_WAIT_S = 5.0  # how long a trainer waits for an engine to confirm a dropped version


class _Done:
    def wait(self):
        pass


class InProcessSender:
    """Hands buckets to a receiver in this process. A consumer with
    ``target(name)`` (:class:`HFModelConsumer`) is written in place unless
    ``in_place=False`` (an FP8 export: the bucket holds what the consumer does not):
    the gather writes straight into its tensors (``push``), with no export buffers."""

    def __init__(self, receiver: WeightReceiver, *, in_place: bool = True):
        self.receiver = receiver
        self.push = in_place and callable(getattr(receiver.consumer, "target", None))
        self.views: dict[str, torch.Tensor] | None = None
        self._fingerprint = None

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self.receiver.set_plan(plan, in_place=self.push)
            if self.push:
                self.views = push_targets(plan, self.receiver.consumer, need_cuda=False)
            self._fingerprint = plan.fingerprint
        self.receiver.begin(version, in_place=self.push)

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        self.receiver.load_bucket(bucket, buf)
        return _Done()

    def finish(self, version: int) -> list[int]:
        if self.push:
            self.receiver.pushed()
        return [self.receiver.finish(version)]

    def abort(self, version: int) -> None:
        self.receiver.abort()

    def close(self) -> None:
        pass


class _RemoteSender:
    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        if not addresses:
            raise ValueError("addresses must name at least one receiver endpoint 'host:port'")
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.chans: list[control.Channel] = []
        try:
            for a in self.addresses:
                self.chans.append(control.connect(a, timeout_s=timeout_s, key=authkey, what="weight receiver"))
        except ControlError as exc:
            self.close()
            raise ReceiverError(
                f"{exc}; start the engine's weight receiver (weight_export.serve) first or fix --refit-target"
            ) from exc
        self._fingerprint = None

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _transport_info(self, buffers) -> dict:
        return {}

    def _expect(self, i: int, kind: str, what: str, timeout_s: float | None = None) -> control.Message:
        ch, address = self.chans[i], self.addresses[i]
        try:
            msg = ch.recv(self.timeout_s if timeout_s is None else timeout_s)
        except ControlError as exc:
            raise ReceiverError(
                f"receiver at {address} died or hung while {what} ({exc}); see the engine's log, "
                "then restart it and export again"
            ) from exc
        if msg.kind == "refuse":
            raise PlanMismatch(f"receiver at {address} refused the plan: {msg['reason']}")
        if msg.kind == "error":
            raise ReceiverError(f"receiver at {address} failed while {what}: {msg['reason']}")
        if msg.kind != kind:
            raise ReceiverError(f"receiver at {address} sent {msg.kind!r}, expected {kind!r} while {what}")
        return msg

    def _send_all(self, kind: str, what: str, **fields) -> None:
        for ch, address in zip(self.chans, self.addresses):
            try:
                ch.send(kind, **fields)
            except ControlError as exc:
                raise ReceiverError(f"receiver at {address} died while {what} ({exc})") from exc

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self._send_all("plan", "sending the plan", plan=plan.to_wire(), info=self._transport_info(buffers))
            for i in range(len(self.chans)):
                self._expect(i, "ready", "checking the plan")
            self._fingerprint = plan.fingerprint
        self._send_all("begin", f"starting version {version}", version=version)

    def finish(self, version: int) -> list[int]:
        self._send_all("end", f"finishing version {version}", version=version)
        return [
            self._expect(i, versions.HOLDS, f"applying version {version}")["version"] for i in range(len(self.chans))
        ]

    def abort(self, version: int) -> list[int | None]:
        """Tell every receiver that ``version`` will not complete; returns the version each
        still holds (None: none complete, or no answer). Best effort and short: a receiver that is
        gone, or still waiting for a bucket that will not come, is skipped after a few seconds (it
        drops the version itself when this trainer closes)."""
        held = []
        for i, ch in enumerate(self.chans):
            try:
                ch.send("abort", version=version)
                held.append(
                    self._expect(i, versions.HOLDS, f"aborting version {version}", min(self.timeout_s, _ABORT_WAIT_S))[
                        "version"
                    ]
                )
            except (ControlError, PlanMismatch):
                held.append(None)
        return held

    def request_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the first receiver's model for ``tokens`` (for :func:`verify_export`)."""
        meta, blob = control.tensor_blob(tokens)
        try:
            self.chans[0].send("forward", tokens=meta, blobs=[blob])
        except ControlError as exc:
            raise ReceiverError(f"receiver at {self.addresses[0]} died while computing logits ({exc})") from exc
        msg = self._expect(0, "logits", "computing logits")
        return control.blob_tensor(msg["logits"], msg.blobs[0])

    def close(self) -> None:
        for ch in self.chans:
            try:
                ch.send("close")
            except ControlError:
                pass
            ch.close()
        self.chans = []


class _Work:
    def __init__(self, work, sender, bucket):
        self.work, self.sender, self.bucket = work, sender, bucket

    def wait(self):
        try:
            self.work.wait()
        except Exception as exc:  # gloo: peer gone; NCCL: timeout/abort
            raise ReceiverError(f"broadcast of bucket {self.bucket} failed ({exc}); a receiver died or hung") from exc


class BroadcastSender(_RemoteSender):
    """Broadcasts each bucket to every receiver over a dedicated process group.

    The trainer's export rank is rank 0 of that group and hosts its store;
    engine ranks ``1..N`` join it when they receive the ``join`` message.
    """

    def __init__(
        self,
        addresses: list[str],
        *,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        store_host: str = "127.0.0.1",
        authkey: bytes | None = None,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        world = len(self.chans) + 1
        key = secrets.token_bytes(32)  # this group's own; it reaches the engines over their authenticated channels
        try:
            store = host_store(store_host, 0, key, timeout_s)
        except OSError as exc:
            raise ControlError(
                f"cannot host the broadcast group's store at {store_host} ({exc}); give store_host= an address "
                "of this machine that the engines reach"
            ) from exc
        for rank in range(1, world):
            self.chans[rank - 1].send(
                "join",
                address=store.address,
                key=key,
                rank=rank,
                world=world,
                backend=backend,
                timeout_s=timeout_s,
            )
        self.store = store
        self.pg = make_group(store, 0, world, backend, timeout_s)
        self.backend = backend

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        return _Work(self.pg.broadcast(buf[: bucket.nbytes], 0), self, bucket.index)

    def close(self) -> None:
        super().close()
        if getattr(self, "store", None) is not None:
            self.store.close()
            self.store = None


def share(buf: torch.Tensor) -> dict:
    """A CUDA IPC handle of ``buf`` as plain data, for another process on this host
    (:func:`open_shared`)."""
    if not buf.is_cuda:
        raise ValueError(f"CUDA IPC shares CUDA tensors, got one on {buf.device}; on CPU use transport='broadcast'")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    if args[0] is not torch.Tensor or args[4] is not torch.storage.TypedStorage:
        raise ValueError(f"cannot share a {args[0].__name__} over {args[4].__name__} through CUDA IPC")
    return {"cuda": control.to_wire(list(args[1:4]) + list(args[5:]))}


def open_shared(handle: dict) -> torch.Tensor:
    """The tensor :func:`share` described (mapped, not copied). Only this fixed rebuild
    runs; the handle is data."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = control.from_wire(handle["cuda"]) if isinstance(handle, dict) and "cuda" in handle else None
    if not isinstance(args, list) or len(args) != 13:
        raise ControlError("malformed CUDA IPC handle from the trainer")
    size, stride, offset, *rest = args
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage, *rest)


class _Ack:
    def __init__(self, sender, index):
        self.sender, self.index = sender, index

    def wait(self):
        for i in range(len(self.sender.chans)):
            msg = self.sender._expect(i, "done", f"loading bucket {self.index}")
            if msg["index"] != self.index:
                raise ReceiverError(f"receiver acknowledged bucket {msg['index']}, expected {self.index}")


class IpcSender(_RemoteSender):
    """Shares the two export buffers (CUDA) with engines on this GPU (handles sent
    once per buffer); each bucket is a notice plus an acknowledgement before reuse."""

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self._slots: dict[int, int] = {}

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        if torch.device(device).type != "cuda":
            raise ValueError(
                f"transport='ipc' shares CUDA buffers with an engine on the same GPU; the model is on "
                f"{device}: use transport='broadcast' (gloo on CPU)"
            )
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _transport_info(self, buffers) -> dict:
        self._slots = {b.data_ptr(): i for i, b in enumerate(buffers)}
        return {"kind": "ipc", "handles": [share(b) for b in buffers]}

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        torch.cuda.current_stream(buf.device).synchronize()  # bytes visible to the engine
        self._send_all("bucket", f"sending bucket {bucket.index}", index=bucket.index, slot=self._slots[buf.data_ptr()])
        return _Ack(self, bucket.index)


class IpcDirectSender(_RemoteSender):
    """Colocated refit without export buffers: the engine maps the trainer's
    parameter storage once and copies every HF tensor straight out of it."""

    direct = True

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self._info = None
        self._device = None

    def prepare(self, transfers, tensors: dict[str, torch.Tensor]) -> None:
        """Share the parameter storage (once) and describe every piece of every HF tensor in it."""
        if any(not t.is_cuda for t in tensors.values()):
            raise ValueError("transport='ipc-direct' needs the model on a CUDA device; use transport='ipc'")
        self._device = next(iter(tensors.values())).device if tensors else None
        self._bases, entries = direct_entries(transfers, tensors)  # keeps the shared storage alive
        self._info = {"kind": "ipc-direct", "handles": [share(b) for b in self._bases], "entries": entries}
        self._fingerprint = None  # new handles: send the plan again

    def _transport_info(self, buffers) -> dict:
        if self._info is None:
            raise RuntimeError("IpcDirectSender.prepare() must run before start()")
        return self._info

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if self._device is not None:
            torch.cuda.current_stream(self._device).synchronize()  # the weights are final
        super().start(plan, buffers, version)

    def send(self, bucket, buf):
        raise RuntimeError("IpcDirectSender has no buckets to send")


class IpcPushSender(_RemoteSender):
    """Colocated refit straight into the engine's weights: the engine shares its
    tensors' storage once (with the plan check), and the trainer's gather writes
    every HF tensor into them, so each byte is copied once and the trainer holds
    no export buffers (pipeline stages other than the first still need two, to
    receive). One engine on this GPU whose consumer has ``target(name)``; the
    engine must not run forward passes while a version is being written."""

    push = True

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        if len(addresses) != 1:
            raise ValueError(
                f"transport='ipc-push' writes into one engine's weights; got {len(addresses)} "
                "targets (use transport='ipc' or 'broadcast' for several engines)"
            )
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self.views: dict[str, torch.Tensor] | None = None
        self._bases: list[torch.Tensor] = []

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self._send_all("plan", "sending the plan", plan=plan.to_wire(), info={"kind": "ipc-push"})
            ready = self._expect(0, "ready", "checking the plan")
            self._bases = [open_shared(h) for h in ready["handles"]]
            self.views = {
                name: self._bases[i].view(dtype).as_strided(shape, stride, offset)
                for name, (i, dtype, shape, stride, offset) in ready["entries"].items()
            }
            self._fingerprint = plan.fingerprint
        self._send_all("begin", f"starting version {version}", version=version)

    def send(self, bucket, buf):
        raise RuntimeError("IpcPushSender writes in place; it has no buckets to send")

    def finish(self, version: int) -> list[int]:
        if self._bases:
            torch.cuda.current_stream(self._bases[0].device).synchronize()  # every write has landed
        return super().finish(version)


def push_targets(plan: ExportPlan, consumer, *, need_cuda: bool = True) -> dict[str, torch.Tensor]:
    """The consumer's tensor (or view) for every tensor of ``plan``, to be written in
    place; raises ValueError saying why a consumer cannot take pushed weights."""
    target = getattr(consumer, "target", None)
    if not callable(target):
        raise ValueError(
            f"{type(consumer).__name__} has no target(name) to write into; transport='ipc-push' "
            "needs an engine that exposes its weights (HFModelConsumer); use transport='ipc'"
        )
    views = {}
    for t in plan.tensors():
        dst = target(t.name)
        if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
            raise ValueError(
                f"{t.name}: engine tensor is {tuple(dst.shape)} {dst.dtype}, the plan sends {tuple(t.shape)} {t.dtype}"
            )
        if need_cuda and not dst.is_cuda:
            raise ValueError(
                f"{t.name} is on {dst.device}; transport='ipc-push' needs the engine's weights on "
                "the trainer's GPU (use transport='ipc' or 'broadcast')"
            )
        views[t.name] = dst
    return views


def _share_targets(views: dict[str, torch.Tensor]):
    """CUDA IPC handles of the storages behind ``views`` and, per name,
    ``[storage index, dtype, shape, stride, offset]`` to rebuild each view."""
    storages: dict[int, int] = {}
    handles, entries = [], {}
    for name, v in views.items():
        storage = v.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = len(handles)
            handles.append(share(_storage_bytes(v)))
        entries[name] = (storages[storage.data_ptr()], v.dtype, tuple(v.shape), tuple(v.stride()), v.storage_offset())
    return handles, entries


def direct_entries(transfers, tensors: dict[str, torch.Tensor]):
    """Each piece of the plan's HF tensors (one trainer rank, TP=1) as a strided view of
    a parameter storage.

    Returns the storages (uint8 tensors spanning each one) and, per piece,
    ``(hf_name, box ranges, storage index, dtype, shape, stride, offset)``.
    """
    storages: dict[int, tuple[int, torch.Tensor]] = {}
    entries = []
    for t in transfers:
        p = tensors[t.src_run.local]
        storage = p.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = (len(storages), _storage_bytes(p))
        src = run_view(p, t.src_run).view(t.box.shape)
        entries.append(
            (
                t.name,
                [list(r) for r in t.box.ranges],
                storages[storage.data_ptr()][0],
                p.dtype,
                tuple(src.shape),
                tuple(src.stride()),
                src.storage_offset(),
            )
        )
    bases = [b for _, b in sorted(storages.values(), key=lambda x: x[0])]
    return bases, entries


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor spanning ``t``'s whole storage (what a CUDA IPC handle shares)."""
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    return base.set_(t.untyped_storage())


def direct_copies(bases, entries, consumer):
    """The receiver's copies for a direct plan, built once per plan: a :class:`~..copies.CopyBatch`
    of ``(destination box, source view)`` pairs, and, for consumers without ``target(name)``,
    ``(name, [(box slices, source view)])`` per tensor (assembled whole before ``load_weights``)."""
    target = getattr(consumer, "target", None)
    pairs, loads = [], {}
    for name, ranges, index, dtype, shape, stride, offset in entries:
        src = bases[index].view(dtype).as_strided(shape, stride, offset)
        box = tuple(slice(a, b) for a, b in ranges)
        if target is not None:
            pairs.append((target(name)[box], src))
        else:
            loads.setdefault(name, []).append((box, src))
    return CopyBatch(pairs), list(loads.items())


def serve(
    consumer,
    address: str,
    *,
    device: torch.device | str = "cpu",
    timeout_s: float = 600.0,
    authkey: bytes | None = None,
    on_version=None,
    atomic: bool = True,
    receiver: WeightReceiver | None = None,
) -> WeightReceiver:
    """Engine-side loop: accept one trainer at ``address`` and apply its exports
    to ``consumer`` until the trainer closes (or goes away). Returns the receiver:
    its ``applied_version`` is the last complete version the consumer holds.
    ``on_version(v)`` runs after each applied version.

    Listens on exactly ``address``; connections that fail the control channel's
    handshake (health checks, port scans, garbage, a wrong key) are logged and
    dropped. ``authkey``: the control channel's shared secret (see
    :func:`.control.resolve_key`). ``atomic`` (default): stage each version in
    one buffer on ``device`` and apply it at its end, so an interrupted version
    leaves the previous one in place; ``atomic=False`` writes buckets as they
    arrive (no staging memory) and, after an interruption, reports no complete
    version (``applied_version`` None) and refuses the verifier's forward passes
    until the next complete version. ``ipc-direct`` and ``ipc-push`` always
    write in place.

    ``receiver``: the one an earlier call returned, to serve the next trainer
    session from what the consumer holds (its version, or that an interrupted
    in-place version left it with none); a fresh one would take the consumer's
    weights for complete. ``consumer``, ``device`` and ``atomic`` are then the
    receiver's."""
    if receiver is None:
        receiver = WeightReceiver(consumer, atomic=atomic, device=device)
    elif receiver.consumer is not consumer:
        raise ValueError("serve(receiver=...) must be the receiver of the same consumer")
    consumer, device = receiver.consumer, receiver.device
    device = torch.device(device)
    with control.Listener(address, key=authkey) as listener:
        try:
            ch = listener.accept(timeout_s)
        except ControlError as exc:
            raise ReceiverError(str(exc)) from exc
    state = _Serving(receiver, consumer, device)
    try:
        while True:
            try:
                try:
                    msg = ch.recv(timeout_s)
                except ControlError as exc:
                    if "closed the connection" in str(exc):
                        raise _TrainerGone(str(exc)) from exc
                    raise ReceiverError(f"weight receiver at {address}: {exc}") from exc
                if msg.kind == "close":
                    break
                state.handle(msg, ch)
            except _TrainerGone as exc:
                if receiver._version is not None:
                    held = receiver.abort()
                    log.warning(
                        "weight receiver at %s: the trainer went away during a version (%s); the engine holds %s",
                        address,
                        exc,
                        versions.describe(held),
                    )
                break
            except PlanMismatch as exc:
                receiver.plan = None
                ch.send("refuse", reason=str(exc))
                continue
            except Exception as exc:
                receiver.abort()
                try:
                    ch.send("error", reason=f"{type(exc).__name__}: {exc}")
                except ControlError:
                    pass
                raise
            if msg.kind == "end" and on_version is not None:
                on_version(receiver.applied_version)
    finally:
        ch.close()
        if state.store is not None:
            state.store.close()
    return receiver


class _TrainerGone(ReceiverError):
    """The trainer closed its connection or its process group went away."""


class _Serving:
    """The engine side of one trainer connection: what each control message does."""

    def __init__(self, receiver: WeightReceiver, consumer, device: torch.device):
        self.receiver, self.consumer, self.device = receiver, consumer, device
        self.pg, self.bufs, self.plan, self.direct, self.push = None, [], None, None, False
        self.store = None  # the broadcast group's store (a client of the trainer's)

    def handle(self, msg: control.Message, ch: control.Channel) -> None:
        r = self.receiver
        if msg.kind == "join":
            self.store = ControlStore(msg["address"], msg["key"], msg["timeout_s"])
            self.pg = make_group(self.store, msg["rank"], msg["world"], msg["backend"], msg["timeout_s"])
        elif msg.kind == "plan":
            self._plan(ExportPlan.from_wire(msg["plan"]), msg["info"], ch)
        elif msg.kind == "begin":
            r.begin(msg["version"], in_place=self.push or self.direct is not None)
            if self.direct is not None:
                r.load_direct(self.direct[1], self.direct[2])
            elif self.pg is not None:
                _receive_broadcast(self.pg, self.plan, self.bufs, r)
        elif msg.kind == "bucket":
            bucket = self.plan.buckets[msg["index"]]
            r.load_bucket(bucket, self.bufs[msg["slot"]])
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            ch.send("done", index=bucket.index)
        elif msg.kind == "end":
            if self.push:
                r.pushed()
            ch.send(versions.HOLDS, version=r.finish(msg["version"]))
        elif msg.kind == "abort":
            ch.send(versions.HOLDS, version=r.abort())
        elif msg.kind == "forward":
            if not r.holds_complete_version:
                ch.send(
                    "error",
                    reason="the engine holds no complete version (the last refit was interrupted "
                    "after it wrote part of the weights); refit again before running it",
                )
                return
            tokens = control.blob_tensor(msg["tokens"], msg.blobs[0])
            meta, blob = control.tensor_blob(self.consumer.logits(tokens))
            ch.send("logits", logits=meta, blobs=[blob])
        else:
            raise ReceiverError(f"unknown message {msg.kind!r} from the trainer")

    def _plan(self, plan: ExportPlan, info: dict, ch: control.Channel) -> None:
        r = self.receiver
        kind = info.get("kind")
        r.set_plan(plan, in_place=kind in ("ipc-push", "ipc-direct"))
        self.plan, self.direct, self.bufs = plan, None, []
        self.push = kind == "ipc-push"
        if self.push:
            try:
                handles, entries = _share_targets(push_targets(plan, self.consumer))
            except ValueError as exc:
                raise PlanMismatch(str(exc)) from None
            torch.cuda.synchronize(self.device)  # nothing of ours still reads the weights
            ch.send("ready", handles=handles, entries=entries)
            return
        if kind == "ipc":
            self.bufs = [open_shared(h) for h in info["handles"]]
        elif kind == "ipc-direct":
            bases = [open_shared(h) for h in info["handles"]]
            self.direct = (bases, *direct_copies(bases, info["entries"], self.consumer))
        elif self.pg is not None and not r.atomic:  # atomic receivers take broadcasts into their staging
            self.bufs = [torch.empty(plan.buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        ch.send("ready")


def _receive_broadcast(pg, plan: ExportPlan, bufs, receiver: WeightReceiver) -> None:
    """Receive every bucket of one version; the next bucket's broadcast is posted
    before the current one is loaded, so receiving and loading overlap. An atomic
    receiver takes each bucket straight into its staging buffer."""
    buckets = plan.buckets
    works = {}

    def target(i):
        b = buckets[i]
        stage = receiver.staging(b)
        return stage if stage is not None else bufs[i % 2][: b.nbytes]

    def post(i):
        works[i] = pg.broadcast(target(i), 0)

    if buckets:
        post(0)
    for i, b in enumerate(buckets):
        try:
            works.pop(i).wait()
        except Exception as exc:  # gloo: the trainer is gone; NCCL: timeout/abort
            raise _TrainerGone(f"the trainer's broadcast of bucket {b.index} failed ({exc})") from exc
        if i + 1 < len(buckets):
            post(i + 1)
        if receiver.staging(b) is not None:
            receiver.arrived(b)
        else:
            receiver.load_bucket(b, bufs[i % 2])


# ------------------------------------------------------------------ registry
def _inprocess(exporter) -> InProcessSender:
    if exporter._receiver is None:
        raise ValueError(
            "transport='inprocess' needs receiver=WeightReceiver(...) "
            "(or pass transport='broadcast'/'ipc' with a target)"
        )
    return InProcessSender(exporter._receiver, in_place=exporter.config.quantize == "none")


def _broadcast(exporter) -> BroadcastSender:
    cfg = exporter.config
    return BroadcastSender(cfg.targets, backend=cfg.resolved_backend(exporter.device), timeout_s=cfg.timeout_s)


def _ipc(exporter) -> IpcSender:
    return IpcSender(exporter.config.targets, timeout_s=exporter.config.timeout_s)


def _ipc_push(exporter) -> IpcPushSender:
    if exporter.device.type != "cuda":
        raise ValueError("transport='ipc-push' needs the model on a CUDA device; use transport='ipc'")
    return IpcPushSender(exporter.config.targets, timeout_s=exporter.config.timeout_s)


def _ipc_direct(exporter) -> IpcDirectSender:
    sizes = {k.upper(): v for k, v in dict(exporter.sizes, pp=exporter.mesh.pp).items()}
    if set(sizes.values()) != {1}:
        raise ValueError(
            "transport='ipc-direct' needs TP=PP=EP=ETP=1, as the engine maps only the export rank's storage "
            f"(got {', '.join(f'{k}={v}' for k, v in sizes.items())}); use transport='ipc'"
        )
    return IpcDirectSender(exporter.config.targets, timeout_s=exporter.config.timeout_s)


# The export hook's ``RefitConfig.transport`` -> its sender's factory (checks what the transport needs, builds it).
SENDERS = {
    "inprocess": _inprocess,
    "broadcast": _broadcast,
    "ipc": _ipc,
    "ipc-push": _ipc_push,
    "ipc-direct": _ipc_direct,
}


def make_sender(exporter):
    """The sender of ``exporter.config.transport`` for the export rank of ``exporter``."""
    return SENDERS[exporter.config.transport](exporter)
