"""The refit's key-value store, spoken over the control channel's authenticated frames.

The process groups that span a trainer job and an engine job (the p2p refit's
:class:`~.refit_group.RefitGroup`, the ``broadcast`` transport's group) need a
``torch.distributed`` store for their backend's rendezvous, and the p2p refit
keeps its control messages there (published layouts, plan fingerprints,
announced versions, acknowledgements). :class:`StoreServer` serves that store
and :class:`ControlStore` is a ``torch.distributed.Store`` client of it, so the
refit has one control protocol (:mod:`.channel`): every connection starts with
the mutual HMAC handshake over a shared key, every operation is one JSON frame
with its values as raw bytes (nothing is unpickled), a connection that fails
the handshake or sends garbage is dropped without disturbing the others, and
the server binds only the address it is given.

Operations: ``set``, ``get`` (waits for the key), ``add``, ``check``, ``wait``,
``multi_get``, ``multi_set``, ``compare_set``, ``append``, ``delete_key``,
``num_keys``. A wait that runs out raises ``torch.distributed.DistStoreError``
naming the keys; a lost server raises ``torch.distributed.DistNetworkError``
naming its address.
"""

from __future__ import annotations

import datetime
import logging
import select
import socket
import threading
import time

import torch.distributed as dist

from .channel import Channel, ControlError, Message, _server_handshake, connect, listen_socket

__all__ = ["ControlStore", "StoreServer"]

log = logging.getLogger(__name__)

_MAX_KEYS = 1 << 16  # keys in one request
_MAX_VALUE = 64 << 20  # bytes of one value (published layouts of large models are a few MiB)
_FRAME_S = 60.0  # a frame that has begun must arrive whole within this


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _keys(msg: Message) -> list[str]:
    keys = msg["keys"]
    if not isinstance(keys, list) or len(keys) > _MAX_KEYS or not all(isinstance(k, str) for k in keys):
        raise ControlError(f"a {msg.kind!r} request with malformed keys")
    return keys


class StoreServer:
    """Serves one store at ``host:port`` (``port`` 0: any free port, see :attr:`port`) to clients
    that know ``key``; a thread per connection, so a client's blocking ``get``/``wait`` does not
    hold up the others. It lives as long as its process unless closed with ``drop_clients``."""

    def __init__(self, host: str, port: int, key: bytes, *, handshake_s: float = 10.0):
        self.key, self.handshake_s = key, handshake_s
        self.sock = listen_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self.rejected = 0  # connections that failed the handshake or broke the protocol
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._chans: set[Channel] = set()
        threading.Thread(target=self._accept, name="megatron_ext-store", daemon=True).start()

    # ---------------------------------------------------------------- connections
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                if not select.select([self.sock], [], [], 0.2)[0]:
                    continue
                sock, peer = self.sock.accept()
            except (OSError, ValueError):  # closed under us
                return
            ch = Channel(sock, f"a store client at {peer[0]}:{peer[1]}")
            threading.Thread(target=self._serve, args=(ch,), name="megatron_ext-store-client", daemon=True).start()

    def _serve(self, ch: Channel) -> None:
        try:
            _server_handshake(ch, self.key, time.monotonic() + self.handshake_s)
        except ControlError as exc:
            self.rejected += 1
            log.warning("refit store at %s: dropped a connection (%s)", self.address, exc)
            ch.close()
            return
        with self._cond:
            self._chans.add(ch)
        try:
            while not self._closed.is_set():
                try:
                    if not select.select([ch], [], [], 0.5)[0]:
                        continue  # a client may stay quiet for as long as it likes between refits
                except (OSError, ValueError):  # closed by close()
                    return
                try:
                    msg = ch.recv(_FRAME_S, max_header=_MAX_VALUE)
                except ControlError as exc:
                    if "closed the connection" not in str(exc) and not self._closed.is_set():
                        self.rejected += 1
                        log.warning("refit store at %s: dropped %s (%s)", self.address, ch.peer, exc)
                    return
                try:
                    kind, fields, blobs = self._handle(msg)
                except ControlError as exc:
                    self.rejected += 1
                    log.warning("refit store at %s: dropped %s (%s)", self.address, ch.peer, exc)
                    return
                ch.send(kind, blobs=blobs, **fields)
        except ControlError:
            return
        finally:
            with self._cond:
                self._chans.discard(ch)
            ch.close()

    # ----------------------------------------------------------------- operations
    def _wait_for(self, keys: list[str], timeout_s) -> bool:
        if not isinstance(timeout_s, (int, float)) or timeout_s < 0:
            raise ControlError("a wait without a valid timeout_s")
        deadline = time.monotonic() + timeout_s
        while not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed.is_set():
                return False
            self._cond.wait(min(left, 0.5))
        return True

    def _handle(self, msg: Message) -> tuple[str, dict, list[bytes]]:
        op, data = msg.kind, self._data
        with self._cond:
            if op in ("set", "multi_set", "append"):
                keys = _keys(msg)
                if len(msg.blobs) != len(keys) or any(len(b) > _MAX_VALUE for b in msg.blobs):
                    raise ControlError(f"a {op!r} request whose values do not match its keys")
                for k, v in zip(keys, msg.blobs):
                    data[k] = data.get(k, b"") + v if op == "append" else v
                self._cond.notify_all()
                return "ok", {}, []
            if op in ("get", "wait"):  # get: the values too
                keys = _keys(msg)
                if not self._wait_for(keys, msg["timeout_s"]):
                    return "timeout", {"missing": [k for k in keys if k not in data]}, []
                return "ok", {}, [data[k] for k in keys] if op == "get" else []
            if op == "add":
                key, amount = msg["key"], msg["amount"]
                if not isinstance(key, str) or not isinstance(amount, int):
                    raise ControlError("an 'add' request with a malformed key or amount")
                try:
                    value = int(data.get(key, b"0")) + amount
                except ValueError:
                    return "refused", {"reason": f"key {key!r} does not hold an integer"}, []
                data[key] = str(value).encode()
                self._cond.notify_all()
                return "ok", {"value": value}, []
            if op == "check":
                return "ok", {"value": all(k in data for k in _keys(msg))}, []
            if op == "compare_set":
                key = msg["key"]
                if not isinstance(key, str) or len(msg.blobs) != 2:
                    raise ControlError("a 'compare_set' request without key, expected and desired value")
                expected, desired = msg.blobs
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = current = desired
                    self._cond.notify_all()
                return "ok", {}, [expected if current is None else current]
            if op == "delete":
                return "ok", {"value": data.pop(msg["key"], None) is not None}, []
            if op == "num_keys":
                return "ok", {"value": len(data)}, []
        raise ControlError(f"unknown store operation {op!r}")

    def close(self, *, drop_clients: bool = False) -> None:
        """Stop taking connections. Clients already connected are still served until they hang up
        (a peer may still be reading its last answer, e.g. the engine's acknowledgement of the
        trainer's close) or the process exits; ``drop_clients`` cuts them off too."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # stop listening now, not when the accept thread lets go
        except OSError:
            pass
        self.sock.close()
        if not drop_clients:
            return
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
            chans = list(self._chans)
        for ch in chans:
            try:
                ch.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ControlStore(dist.Store):
    """A ``torch.distributed.Store`` whose operations go to the :class:`StoreServer` at ``address``
    over one authenticated control channel (connecting waits for the server up to ``timeout_s``).
    Blocking operations (``get``, ``wait``, ``multi_get``) wait up to ``timeout_s`` unless given a
    timeout. Backends may call it from their own threads: one request at a time."""

    def __init__(self, address: str, key: bytes, timeout_s: float, *, server: StoreServer | None = None):
        super().__init__()
        self.address, self._key, self.timeout_s = address, key, float(timeout_s)
        self._server = server  # refit rank 0 keeps its server alive with its own client
        self._lock = threading.Lock()
        self._twins: list[ControlStore] = []
        self._chan = connect(address, timeout_s=timeout_s, key=key, what="refit store")

    # --------------------------------------------------------------------- wire
    def _call(self, op: str, *, blobs=(), wait_s: float | None = None, **fields) -> Message:
        with self._lock:
            if self._chan is None:
                raise dist.DistNetworkError(f"the refit store client for {self.address} is closed")
            try:
                self._chan.send(op, blobs=blobs, **fields)
                # a blocking operation's answer comes once the server's own wait ran out
                reply = self._chan.recv((wait_s or 0.0) + self.timeout_s, max_header=_MAX_VALUE)
            except ControlError as exc:
                raise dist.DistNetworkError(
                    f"lost the refit store at {self.address} ({exc}); did the job that hosts it (refit rank 0, "
                    "the trainer's first rank) exit?"
                ) from exc
        if reply.kind == "timeout":
            raise dist.DistStoreError(
                f"the refit store at {self.address}: keys {reply['missing']} not set within {wait_s:g}s"
            )
        if reply.kind == "refused":
            raise ValueError(f"the refit store at {self.address} refused {op!r}: {reply['reason']}")
        return reply

    def _wait_s(self, timeout) -> float:
        return self.timeout_s if timeout is None else _seconds(timeout)

    # ---------------------------------------------------------- the Store interface
    def set(self, key: str, value) -> None:
        self._call("set", keys=[key], blobs=[_bytes(value)])

    def multi_set(self, keys: list[str], values: list) -> None:
        self._call("multi_set", keys=list(keys), blobs=[_bytes(v) for v in values])

    def append(self, key: str, value) -> None:
        self._call("append", keys=[key], blobs=[_bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call("get", keys=[key], timeout_s=self.timeout_s, wait_s=self.timeout_s).blobs[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("get", keys=list(keys), timeout_s=self.timeout_s, wait_s=self.timeout_s).blobs

    def wait(self, keys: list[str], timeout=None) -> None:
        t = self._wait_s(timeout)
        self._call("wait", keys=list(keys), timeout_s=t, wait_s=t)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key=key, amount=int(amount))["value"]

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys=list(keys))["value"]

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", key=key, blobs=[_bytes(expected), _bytes(desired)]).blobs[0]

    def delete_key(self, key: str) -> bool:
        return self._call("delete", key=key)["value"]

    deleteKey = delete_key  # the names torch's C++ side calls them by

    def num_keys(self) -> int:
        return self._call("num_keys")["value"]

    getNumKeys = num_keys

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "ControlStore":
        """A second client of the same server (its own connection), for a backend's other threads."""
        twin = ControlStore(self.address, self._key, self.timeout_s)
        self._twins.append(twin)  # torch holds only the C++ side: keep the Python object alive
        return twin

    def close(self) -> None:
        """Close this client; on the rank that hosts the server, stop the server too."""
        for twin in self._twins:
            twin.close()
        with self._lock:
            if self._chan is not None:
                self._chan.close()
                self._chan = None
        if self._server is not None:
            self._server.close()
            self._server = None


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def host_store(host: str, port: int, key: bytes, timeout_s: float) -> ControlStore:
    """Serve a store at ``host:port`` (bound to that address only) and return this process's client."""
    server = StoreServer(host, port, key)
    return ControlStore(f"{host}:{server.port}", key, timeout_s, server=server)
