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

The control connection (:mod:`..control.channel`: authenticated JSON frames, never
pickles) carries the plan, version begin/end/abort (each answered with the
version the engine holds, :mod:`..control.versions`), per-bucket IPC notices and the
verifier's tokens and logits; tensors never travel on
it. A receiver that dies closes it, so the trainer fails at once with
:class:`ReceiverError`; one that hangs fails it after ``timeout_s``.
:func:`serve` is the matching engine-side loop; by default it stages a whole
version and applies it at the end, so a trainer that dies mid-refit leaves the
engine's previous version in place.

The senders live one module per transport (:mod:`.inprocess`, :mod:`.broadcast`, :mod:`.ipc`,
:mod:`.ipc_push`, :mod:`.ipc_direct`; :mod:`.remote` is what the remote ones share), the engine's
loop in :mod:`.serve`; :data:`SENDERS` is the registry.
"""

from __future__ import annotations

from ..plan.errors import ReceiverError
from .broadcast import BroadcastSender
from .inprocess import InProcessSender, push_targets
from .ipc import IpcSender
from .ipc_direct import IpcDirectSender
from .ipc_push import IpcPushSender
from .remote import _RemoteSender
from .serve import serve

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
    """The sender of ``exporter.config.transport`` for the export rank of ``exporter``; one to another
    process sends ``exporter.hf_config`` with the plan (an engine without a model builds it from that)."""
    sender = SENDERS[exporter.config.transport](exporter)
    if isinstance(sender, _RemoteSender):
        sender.hf_config = exporter.hf_config
    return sender
