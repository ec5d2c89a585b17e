""":func:`serve`: the engine side of every export-hook transport, one trainer connection at a time,
applying each version to a consumer through a :class:`~..engines.receiver.WeightReceiver`."""

from __future__ import annotations

import logging

import torch

from ... import copy_check

from ..control import channel as control
from ..control import versions
from ..control.channel import ControlError
from ..control.refit_group import make_group
from ..control.store import ControlStore
from ..engines.receiver import WeightReceiver
from ..plan.errors import NonFiniteWeights, ReceiverError
from ..plan.export_plan import ExportPlan, PlanMismatch
from .inprocess import push_targets
from .ipc import open_shared
from .ipc_direct import direct_copies
from .ipc_push import _share_targets

__all__ = ["serve"]

log = logging.getLogger(__name__)


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
    :func:`..control.channel.resolve_key`). ``atomic`` (default): stage each version in
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
    receiver's.

    A consumer with ``configure(hf_config)`` (:class:`~..engines.hf_model.HFModelFromTrainer`)
    is handed the Hugging Face config the trainer sends with each plan, before the plan check,
    and builds its model from it (or refuses the plan, saying why)."""
    if receiver is None:
        receiver = WeightReceiver(consumer, atomic=atomic, device=device)
    elif receiver.consumer is not consumer:
        raise ValueError("serve(receiver=...) must be the receiver of the same consumer")
    consumer, device = receiver.consumer, receiver.device
    device = torch.device(device)
    # the checked copies' kernel (ipc-direct: the engine checks as it copies) compiles while no trainer is here
    copy_check.prewarm(device, (torch.bfloat16, torch.float32))
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
            configure = getattr(self.consumer, "configure", None)
            if callable(configure):  # a consumer that builds its model from the trainer's config (HFModelFromTrainer)
                configure(msg.fields.get("hf_config"))
            self._plan(ExportPlan.from_wire(msg["plan"]), msg["info"], ch)
        elif msg.kind == "begin":
            r.begin(msg["version"], in_place=self.push or self.direct is not None)
            if self.direct is not None:
                r.load_direct(self.direct[1], self.direct[2], check=bool(msg.fields.get("check")))
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
            try:
                ch.send(versions.HOLDS, version=r.finish(msg["version"]))
            except NonFiniteWeights as exc:  # found by the engine's own copy (ipc-direct): written, not complete
                ch.send(versions.HOLDS, version=r.abort(), nonfinite=exc.names)
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
