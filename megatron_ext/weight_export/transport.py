"""Moving bucket bytes from the exporting trainer rank to receivers.

Senders (trainer side) share one protocol::

    sender.allocate(nbytes, device)      # the export buffers (IPC shares them)
    sender.start(plan, buffers, version) # plan sent and checked once per layout
    handle = sender.send(bucket, buf)    # handle.wait(): buf may be reused
    sender.finish(version) -> [applied version reported by each receiver]

- :class:`InProcessSender`: a :class:`WeightReceiver` in the same process.
- :class:`BroadcastSender`: one ``broadcast`` per bucket over a process group
  that only the trainer's export rank and the engine ranks join (NCCL on GPUs,
  gloo on CPU). Metadata goes once over the control connection; then only bytes.
- :class:`IpcSender`: an engine on the same GPU maps the two export buffers
  through CUDA IPC handles sent once per buffer (on CPU: shared-memory files),
  and acknowledges each bucket before its buffer is reused.
- :class:`IpcDirectSender` (CUDA, TP=PP=EP=1 trainers): no export buffers; the
  engine maps the trainer's parameter storage (one handle per storage, sent
  with the plan) and copies each HF tensor straight out of it: one copy per
  refit instead of two.

The control connection (:mod:`multiprocessing.connection`, authenticated) carries
the plan, version begin/end, per-bucket IPC notices and acknowledgements. A
receiver that dies closes it, so the trainer fails at once with
:class:`ReceiverError`; one that hangs fails it after ``timeout_s``.
:func:`serve` is the matching engine-side loop.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist

from .plan import BucketMeta, ExportPlan, PlanMismatch
from .receiver import WeightReceiver

__all__ = ["BroadcastSender", "InProcessSender", "IpcDirectSender", "IpcPushSender", "IpcSender", "ReceiverError",
           "push_targets", "serve"]

DEFAULT_AUTHKEY = b"megatron_ext.weight_export"
AUTHKEY_ENV = "MEGATRON_EXT_EXPORT_AUTHKEY"
_LOOPBACK = ("127.", "localhost", "::1")


def resolve_authkey(authkey: bytes | None, address: str) -> bytes:
    """The control channel's shared secret: ``authkey``, else ``$MEGATRON_EXT_EXPORT_AUTHKEY``,
    else (loopback addresses only) a built-in default. The channel carries pickled
    messages, so a listener reachable from other hosts must not use a well-known key."""
    if authkey is not None:
        return authkey
    env = os.environ.get(AUTHKEY_ENV)
    if env:
        return env.encode()
    host, _ = parse_address(address)
    if host.startswith(_LOOPBACK):
        return DEFAULT_AUTHKEY
    raise ValueError(
        f"weight-export control address {address!r} is not loopback: set the same secret on the "
        f"trainer and the engine (authkey=... or the {AUTHKEY_ENV} environment variable)")


class ReceiverError(RuntimeError):
    """A receiver refused, died or did not answer in time."""


class _Done:
    def wait(self):
        pass


class InProcessSender:
    """Hands buckets to a receiver in this process. A consumer with
    ``target(name)`` (:class:`HFModelConsumer`) is written in place: the gather
    writes straight into its tensors (``push``), with no export buffers."""

    def __init__(self, receiver: WeightReceiver):
        self.receiver = receiver
        self.push = callable(getattr(receiver.consumer, "target", None))
        self.views: dict[str, torch.Tensor] | None = None
        self._fingerprint = None

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self.receiver.set_plan(plan)
            if self.push:
                self.views = push_targets(plan, self.receiver.consumer, need_cuda=False)
            self._fingerprint = plan.fingerprint
        self.receiver.begin(version)

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        self.receiver.load_bucket(bucket, buf)
        return _Done()

    def finish(self, version: int) -> list[int]:
        if self.push:
            self.receiver.pushed()
        return [self.receiver.finish(version)]

    def close(self) -> None:
        pass


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host, int(port)


def _no_delay(conn: Connection) -> Connection:
    """Turn off Nagle's algorithm: control messages are small and latency-bound
    (with it, each reply can wait ~40 ms for a delayed ACK)."""
    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()  # closes the duplicate descriptor only
    return conn


def _connect(address: str, timeout_s: float, authkey: bytes) -> Connection:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _no_delay(Client(parse_address(address), authkey=resolve_authkey(authkey, address)))
        except (ConnectionRefusedError, FileNotFoundError, OSError) as exc:
            if time.monotonic() > deadline:
                raise ReceiverError(
                    f"no receiver listening at {address} after {timeout_s:.0f}s ({exc}); start the engine's "
                    "weight receiver (weight_export.serve) first or fix --weight-export-target") from exc
            time.sleep(0.1)


class _RemoteSender:
    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        if not addresses:
            raise ValueError("addresses must name at least one receiver endpoint 'host:port'")
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.conns = [_connect(a, timeout_s, authkey) for a in self.addresses]
        self._fingerprint = None

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _transport_info(self, buffers) -> dict:
        return {}

    def _expect(self, i: int, kind: str, what: str):
        conn, address = self.conns[i], self.addresses[i]
        try:
            if not conn.poll(self.timeout_s):
                raise ReceiverError(f"receiver at {address} did not answer within {self.timeout_s:.0f}s "
                                    f"while {what}; it is hung or overloaded")
            msg = conn.recv()
        except (EOFError, ConnectionError, OSError) as exc:
            raise ReceiverError(f"receiver at {address} died while {what} ({type(exc).__name__}); "
                                "see the engine's log, then restart it and export again") from exc
        if msg[0] == "refuse":
            raise PlanMismatch(f"receiver at {address} refused the plan: {msg[1]}")
        if msg[0] == "error":
            raise ReceiverError(f"receiver at {address} failed while {what}: {msg[1]}")
        if msg[0] != kind:
            raise ReceiverError(f"receiver at {address} sent {msg[0]!r}, expected {kind!r} while {what}")
        return msg

    def _send_all(self, msg, what: str) -> None:
        for conn, address in zip(self.conns, self.addresses):
            try:
                conn.send(msg)
            except (ConnectionError, OSError) as exc:
                raise ReceiverError(f"receiver at {address} died while {what} ({exc})") from exc

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self._send_all(("plan", plan, self._transport_info(buffers)), "sending the plan")
            for i in range(len(self.conns)):
                self._expect(i, "ready", "checking the plan")
            self._fingerprint = plan.fingerprint
        self._send_all(("begin", version), f"starting version {version}")

    def finish(self, version: int) -> list[int]:
        self._send_all(("end", version), f"finishing version {version}")
        return [self._expect(i, "applied", f"applying version {version}")[1] for i in range(len(self.conns))]

    def request_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the first receiver's model for ``tokens`` (for :func:`verify_export`)."""
        self.conns[0].send(("forward", tokens.cpu()))
        return self._expect(0, "logits", "computing logits")[1]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("close",))
                conn.close()
            except OSError:
                pass


class _Work:
    def __init__(self, work, sender, bucket):
        self.work, self.sender, self.bucket = work, sender, bucket

    def wait(self):
        try:
            self.work.wait()
        except Exception as exc:  # gloo: peer gone; NCCL: timeout/abort
            raise ReceiverError(f"broadcast of bucket {self.bucket} failed ({exc}); a receiver died or hung"
                                ) from exc


class BroadcastSender(_RemoteSender):
    """Broadcasts each bucket to every receiver over a dedicated process group.

    The trainer's export rank is rank 0 of that group and hosts its store;
    engine ranks ``1..N`` join it when they receive the ``join`` message.
    """

    def __init__(self, addresses: list[str], *, backend: str = "gloo", timeout_s: float = 120.0,
                 store_host: str = "127.0.0.1", authkey: bytes | None = None):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        world = len(self.conns) + 1
        store = dist.TCPStore(store_host, 0, world, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        for rank, conn in enumerate(self.conns, start=1):
            conn.send(("join", store_host, store.port, rank, world, backend, timeout_s))
        self.store = store
        self.pg = make_group(store, 0, world, backend, timeout_s)
        self.backend = backend

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        return _Work(self.pg.broadcast(buf[:bucket.nbytes], 0), self, bucket.index)

    def close(self) -> None:
        super().close()


def make_group(store, rank: int, world: int, backend: str, timeout_s: float):
    """A process group over ``store`` outside the default world (trainer + engines only)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = dist.PrefixStore("megatron_ext_weight_export", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefix, rank, world, opts)


def share(buf: torch.Tensor):
    """A picklable handle another process on this host opens with :func:`open_shared`."""
    if buf.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return ("cuda", reduce_tensor(buf))
    return ("file", getattr(buf, "_shm_path"), buf.numel())


def open_shared(handle) -> torch.Tensor:
    if handle[0] == "cuda":
        fn, args = handle[1]
        return fn(*args)
    _, path, nbytes = handle
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class _Ack:
    def __init__(self, sender, index):
        self.sender, self.index = sender, index

    def wait(self):
        for i in range(len(self.sender.conns)):
            msg = self.sender._expect(i, "done", f"loading bucket {self.index}")
            if msg[1] != self.index:
                raise ReceiverError(f"receiver acknowledged bucket {msg[1]}, expected {self.index}")


class IpcSender(_RemoteSender):
    """Shares the two export buffers with engines on this GPU (handles sent once
    per buffer); each bucket is a notice plus an acknowledgement before reuse."""

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self._slots: dict[int, int] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="megatron_ext_ipc_", dir="/dev/shm"
                                                if os.path.isdir("/dev/shm") else None)

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        path = os.path.join(self._tmp.name, f"buf{len(os.listdir(self._tmp.name))}")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        buf._shm_path = path
        return buf

    def _transport_info(self, buffers) -> dict:
        self._slots = {b.data_ptr(): i for i, b in enumerate(buffers)}
        return {"kind": "ipc", "handles": [share(b) for b in buffers]}

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()  # bytes visible to the engine
        self._send_all(("bucket", bucket.index, self._slots[buf.data_ptr()]), f"sending bucket {bucket.index}")
        return _Ack(self, bucket.index)

    def close(self) -> None:
        super().close()
        self._tmp.cleanup()


class IpcDirectSender(_RemoteSender):
    """Colocated refit without export buffers: the engine maps the trainer's
    parameter storage once and copies every HF tensor straight out of it."""

    direct = True

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self._info = None
        self._device = None

    def prepare(self, sources, params: dict[str, torch.Tensor]) -> None:
        """Share the parameter storage (once) and describe every HF tensor in it."""
        if any(not params[src.local_name].is_cuda for src in sources):
            raise ValueError("transport='ipc-direct' needs the model on a CUDA device; use transport='ipc'")
        self._device = params[sources[0].local_name].device if sources else None
        self._bases, entries = direct_entries(sources, params)  # keeps the shared storage alive
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
            raise ValueError(f"transport='ipc-push' writes into one engine's weights; got {len(addresses)} "
                             "targets (use transport='ipc' or 'broadcast' for several engines)")
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self.views: dict[str, torch.Tensor] | None = None
        self._bases: list[torch.Tensor] = []

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self._send_all(("plan", plan, {"kind": "ipc-push"}), "sending the plan")
            handles, entries = self._expect(0, "ready", "checking the plan")[1]
            self._bases = [open_shared(h) for h in handles]
            self.views = {name: self._bases[i].view(dtype).as_strided(shape, stride, offset)
                          for name, (i, dtype, shape, stride, offset) in entries.items()}
            self._fingerprint = plan.fingerprint
        self._send_all(("begin", version), f"starting version {version}")

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
        raise ValueError(f"{type(consumer).__name__} has no target(name) to write into; transport='ipc-push' "
                         "needs an engine that exposes its weights (HFModelConsumer); use transport='ipc'")
    views = {}
    for t in plan.tensors():
        dst = target(t.name)
        if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
            raise ValueError(f"{t.name}: engine tensor is {tuple(dst.shape)} {dst.dtype}, the plan sends "
                             f"{tuple(t.shape)} {t.dtype}")
        if need_cuda and not dst.is_cuda:
            raise ValueError(f"{t.name} is on {dst.device}; transport='ipc-push' needs the engine's weights on "
                             "the trainer's GPU (use transport='ipc' or 'broadcast')")
        views[t.name] = dst
    return views


def _share_targets(views: dict[str, torch.Tensor]):
    """CUDA IPC handles of the storages behind ``views`` and, per name,
    ``(storage index, dtype, shape, stride, offset)`` to rebuild each view."""
    storages: dict[int, int] = {}
    handles, entries = [], {}
    for name, v in views.items():
        storage = v.untyped_storage()
        if storage.data_ptr() not in storages:
            base = torch.empty(0, dtype=torch.uint8, device=v.device)
            base.set_(storage)
            storages[storage.data_ptr()] = len(handles)
            handles.append(share(base))
        entries[name] = (storages[storage.data_ptr()], v.dtype, tuple(v.shape), tuple(v.stride()),
                         v.storage_offset())
    return handles, entries


def direct_entries(sources, params: dict[str, torch.Tensor]):
    """Each HF tensor of ``sources`` (TP=1) as strided views of parameter storages.

    Returns the storages (uint8 tensors spanning each one) and, per copy,
    ``(hf_name, dst shape, dst stride, dst offset, storage index, dtype,
    src shape, src stride, src offset)``.
    """
    from .hf_mapping import shard_copies

    storages: dict[int, tuple[int, torch.Tensor]] = {}
    entries = []
    for s in sources:
        p = params[s.local_name].detach()
        storage = p.untyped_storage()
        if storage.data_ptr() not in storages:
            base = torch.empty(0, dtype=torch.uint8, device=p.device)
            base.set_(storage)
            storages[storage.data_ptr()] = (len(storages), base)
        index = storages[storage.data_ptr()][0]
        dests = [torch.empty(shape, dtype=s.dtype, device="meta") for _, shape in s.outputs]
        for dst, src in shard_copies(s, p, 0, 1, dests):
            owner = dst._base if dst._base is not None else dst
            (name,) = [n for (n, _), d in zip(s.outputs, dests) if d is owner]
            entries.append((name, tuple(dst.shape), tuple(dst.stride()), dst.storage_offset(), index, s.dtype,
                            tuple(src.shape), tuple(src.stride()), src.storage_offset()))
    bases = [b for _, b in sorted(storages.values(), key=lambda x: x[0])]
    return bases, entries


def direct_copies(bases, entries, consumer):
    """The receiver's ``(destination, source view)`` pairs for a direct plan, or
    ``(name, source view)`` loads for consumers without ``target(name)``."""
    target = getattr(consumer, "target", None)
    pairs, loads = [], []
    for name, dshape, dstride, doff, index, dtype, sshape, sstride, soff in entries:
        src = bases[index].view(dtype).as_strided(sshape, sstride, soff)
        if target is not None:
            pairs.append((_dest_view(target(name), name, dshape, dstride, doff), src))
        else:
            loads.append((name, src))
    return pairs, loads


def _dest_view(dst: torch.Tensor, name: str, shape, stride, offset) -> torch.Tensor:
    """The part of ``dst`` that an entry describes relative to a contiguous tensor of
    ``dst``'s shape (``dst`` may be a view, e.g. one expert of a fused parameter)."""
    if tuple(shape) == tuple(dst.shape) and offset == 0:
        return dst  # the whole tensor
    if not dst.is_contiguous():
        raise ValueError(f"ipc-direct cannot place part of {name!r} in a non-contiguous receiver tensor; "
                         "use transport='ipc'")
    return dst.as_strided(shape, stride, dst.storage_offset() + offset)


def serve(consumer, address: str, *, device: torch.device | str = "cpu", timeout_s: float = 600.0,
          authkey: bytes | None = None, on_version=None) -> WeightReceiver:
    """Engine-side loop: accept one trainer at ``address`` and apply its exports
    to ``consumer`` until the trainer closes. Returns the receiver (its
    ``applied_version`` is the last complete version). ``on_version(v)`` runs
    after each applied version."""
    receiver = WeightReceiver(consumer)
    device = torch.device(device)
    with Listener(parse_address(address), authkey=resolve_authkey(authkey, address)) as listener:
        sock = getattr(getattr(listener, "_listener", None), "_socket", None)
        if sock is not None:
            sock.settimeout(timeout_s)
        try:
            conn = _no_delay(listener.accept())
        except TimeoutError as exc:
            raise ReceiverError(f"no trainer connected to {address} within {timeout_s:.0f}s") from exc
    pg, bufs, plan, direct, push = None, [], None, None, False
    try:
        while True:
            if not conn.poll(timeout_s):
                raise ReceiverError(f"trainer sent nothing for {timeout_s:.0f}s")
            try:
                msg = conn.recv()
            except EOFError:
                break
            kind = msg[0]
            if kind == "join":
                _, host, port, rank, world, backend, t = msg
                store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=t))
                pg = make_group(store, rank, world, backend, t)
            elif kind == "plan":
                try:
                    receiver.set_plan(msg[1])
                except PlanMismatch as exc:
                    conn.send(("refuse", str(exc)))
                    continue
                plan, info = msg[1], msg[2]
                push = info.get("kind") == "ipc-push"
                if push:
                    try:
                        shared = _share_targets(push_targets(plan, consumer))
                    except ValueError as exc:
                        receiver.plan = None
                        conn.send(("refuse", str(exc)))
                        continue
                    torch.cuda.synchronize(device)  # nothing of ours still reads the weights
                    conn.send(("ready", shared))
                    continue
                if info.get("kind") == "ipc":
                    bufs = [open_shared(h) for h in info["handles"]]
                elif info.get("kind") == "ipc-direct":
                    bases = [open_shared(h) for h in info["handles"]]
                    direct = (bases, *direct_copies(bases, info["entries"], consumer))
                elif pg is not None:
                    bufs = [torch.empty(plan.buffer_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
                conn.send(("ready",))
            elif kind == "begin":
                receiver.begin(msg[1])
                if direct is not None:
                    receiver.load_direct(direct[1], direct[2])
                elif pg is not None:
                    _receive_broadcast(pg, plan, bufs, receiver)
            elif kind == "bucket":
                _, index, slot = msg
                receiver.load_bucket(plan.buckets[index], bufs[slot])
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                conn.send(("done", index))
            elif kind == "end":
                if push:
                    receiver.pushed()
                conn.send(("applied", receiver.finish(msg[1])))
                if on_version is not None:
                    on_version(receiver.applied_version)
            elif kind == "forward":
                conn.send(("logits", consumer.logits(msg[1])))
            elif kind == "close":
                break
            else:
                raise ReceiverError(f"unknown message {kind!r} from the trainer")
    except Exception as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise
    finally:
        conn.close()
    return receiver


def _receive_broadcast(pg, plan: ExportPlan, bufs, receiver: WeightReceiver) -> None:
    """Receive every bucket of one version; the next bucket's broadcast is posted
    before the current one is loaded, so receiving and loading overlap."""
    buckets = plan.buckets
    works = {}

    def post(i):
        b = buckets[i]
        works[i] = pg.broadcast(bufs[i % 2][:b.nbytes], 0)

    if buckets:
        post(0)
    for i, b in enumerate(buckets):
        works.pop(i).wait()
        if i + 1 < len(buckets):
            post(i + 1)
        receiver.load_bucket(b, bufs[i % 2])
