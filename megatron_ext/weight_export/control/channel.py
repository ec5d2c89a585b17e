"""The control channel between a trainer and an engine: authenticated frames of data, never code.

Plans, version begin/end, acknowledgements and the verifier's logits travel
over one TCP connection per engine; bucket bytes never do (they go through a
process group or CUDA IPC). The wire format is plain data a stranger cannot turn
into code execution:

- a frame is a 4-byte big-endian length and a UTF-8 JSON object with a
  ``"kind"``; binary payloads (e.g. logits) follow as raw bytes whose sizes the
  JSON lists under ``"blobs"``. Nothing is unpickled; sizes are bounded.
- every connection starts with a mutual HMAC-SHA256 challenge-response over a
  shared key (:func:`resolve_key`): explicit, ``$MEGATRON_EXT_EXPORT_AUTHKEY``,
  or, when the address resolves to loopback only, a random per-user key file
  that the engine creates (mode 0600 in a 0700 directory) and the trainer on
  the same host reads. Off loopback a key must be given; no key is built in.
- every wait has a deadline and its error names the peer. A listener survives
  connections that fail the handshake (a health check's bare connect, a port
  scan, garbage, a wrong key): it logs them and keeps waiting for its trainer.
- a listener binds only the address it is given.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import select
import socket
import stat
import struct
import tempfile
import time
from typing import Any
from collections.abc import Sequence

import torch

from ..plan.errors import ControlError
from ..plan.wire import dtype_name, dtype_of

__all__ = [
    "PORTS",
    "Channel",
    "ControlError",
    "KEY_ENV",
    "Listener",
    "Message",
    "blob_tensor",
    "connect",
    "is_loopback",
    "listen_socket",
    "parse_address",
    "resolve_key",
    "tensor_blob",
]

log = logging.getLogger(__name__)

KEY_ENV = "MEGATRON_EXT_EXPORT_AUTHKEY"
# Raised when what two jobs exchange or how both ends cut a reshard refit's pairs changes, so that a trainer and an
# engine of other versions refuse at the handshake, naming both, instead of at the agreement (2: small pairs in
# a bucket of their own, one more word per rank)
PROTOCOL = "megatron_ext.control/2"
MAX_HEADER_BYTES = 64 << 20  # a JSON header (a plan of ~10^5 tensors is a few MiB)
MAX_BLOB_BYTES = 4 << 30  # one binary payload (logits of a verify batch)
_HANDSHAKE_HEADER_BYTES = 4096
_LEN = struct.Struct(">I")
_WARN_AFTER_S = 5.0  # when a connect that keeps being refused says so
PORTS = (1, 65535)


# ----------------------------------------------------------------------------- addresses
def _host_port(addr: str) -> tuple[str, int] | None:
    """``"host:port"`` as ``(host, port)``; None if it is not of that form or the port is not in
    ``PORTS`` (1..65535). The one parser of engine targets, refit stores and listen addresses."""
    host, _, port = addr.strip().rpartition(":")
    if not (host and port.isascii() and port.isdigit() and PORTS[0] <= int(port) <= PORTS[1]):
        return None
    return host, int(port)


def parse_address(addr: str, what: str = "the address") -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; ValueError naming ``what`` otherwise."""
    parsed = _host_port(addr) if isinstance(addr, str) else None
    if parsed is None:
        raise ValueError(f"{what} must be 'host:port' with a port in {PORTS[0]}..{PORTS[1]}, got {addr!r}")
    return parsed


# ----------------------------------------------------------------------------- keys
def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (decided on the
    resolved addresses, not the name: ``localhost.example.com`` or ``127.attacker.example``
    are only loopback if they resolve there). Unresolvable hosts are not loopback."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    addrs = {info[4][0] for info in infos}
    try:
        return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)
    except ValueError:
        return False


def _key_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"megatron_ext-{os.getuid()}")


def _private_dir(path: str) -> str:
    """``path`` as a directory only this user can enter (created 0700; refused if another
    user owns it or others may write to it, e.g. a directory planted in /tmp)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ControlError(
            f"{path} must be a directory owned by this user with mode 0700 (it holds the control "
            f"channel's key); remove it, or set {KEY_ENV} on the trainer and the engine"
        )
    return path


def _user_key(create: bool) -> bytes | None:
    """This user's loopback key, created on first use by an engine (``create``)."""
    path = os.path.join(_private_dir(_key_dir()), "control.key")
    if create and not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.close(fd)
            os.link(tmp, path)  # atomic: a concurrent engine's key wins, ours is dropped
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    try:
        with open(path, "rb") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def resolve_key(address: str, key: bytes | str | None = None, *, create: bool = False) -> bytes:
    """The shared secret for the control channel at ``address``: ``key``, else
    ``$MEGATRON_EXT_EXPORT_AUTHKEY``, else (loopback addresses only) this user's
    key file, which the engine side creates (``create=True``). Raises ValueError
    for an address off loopback without a key, ControlError on the trainer side
    when no engine on this host has created the key file yet."""
    if key is not None:
        return key.encode() if isinstance(key, str) else bytes(key)
    env = os.environ.get(KEY_ENV)
    if env:
        return env.encode()
    host, _ = parse_address(address, "the control address")
    if not is_loopback(host):
        raise ValueError(
            f"control address {address!r} is not loopback: set the same secret on the trainer and the "
            f"engine (authkey=... or the {KEY_ENV} environment variable)"
        )
    found = _user_key(create)
    if found is None:
        raise ControlError(
            f"no control key in {_key_dir()} yet: nothing has served at {address} on this host as "
            f"this user; start the engine (weight_export.serve) first, or set {KEY_ENV} on both sides"
        )
    return found


# ---------------------------------------------------------------------- payloads
def tensor_blob(t: torch.Tensor) -> tuple[dict, bytes]:
    """``(meta, bytes)`` of a tensor for a frame's blobs (copied to the CPU)."""
    t = t.detach().contiguous().cpu()
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}, t.view(torch.uint8).numpy().tobytes()


def blob_tensor(meta: dict, blob: bytes) -> torch.Tensor:
    """The tensor :func:`tensor_blob` sent; its size is checked against ``meta``."""
    dtype = dtype_of(meta.get("dtype", ""))
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ControlError(f"bad tensor shape {shape!r} on the control channel")
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != len(blob):
        raise ControlError(f"a tensor of shape {shape} {dtype} needs {numel * dtype.itemsize} bytes, got {len(blob)}")
    if not blob:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dtype).reshape(shape)


def to_wire(value: Any) -> Any:
    """``value`` with bytes, dtypes and tuples made JSON-able (undone by :func:`from_wire`)."""
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, (list, tuple, torch.Size)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_wire(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{type(value).__name__} cannot go over the control channel")


def from_wire(value: Any) -> Any:
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        if set(value) == {"__dtype__"}:
            return dtype_of(value["__dtype__"])
        return {k: from_wire(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------- channel
@dataclasses.dataclass
class Message:
    kind: str
    fields: dict
    blobs: list[bytes]

    def __getitem__(self, key: str):
        try:
            return self.fields[key]
        except KeyError:
            raise ControlError(f"a {self.kind!r} message without {key!r}") from None


class Channel:
    """One authenticated connection. :meth:`send` / :meth:`recv` move :class:`Message`s;
    every read has a deadline and errors name ``peer``."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small, latency-bound messages

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, kind: str, *, blobs: Sequence[bytes] = (), **fields) -> None:
        header = json.dumps(
            {"kind": kind, "blobs": [len(b) for b in blobs], **to_wire(fields)}, separators=(",", ":")
        ).encode()
        try:
            self.sock.settimeout(None)
            self.sock.sendall(_LEN.pack(len(header)) + header)
            for b in blobs:
                self.sock.sendall(b)
        except OSError as exc:
            raise ControlError(f"{self.peer} went away while we sent {kind!r} ({exc})") from exc

    def recv(self, timeout_s: float, *, max_header: int = MAX_HEADER_BYTES) -> Message:
        """The next message; :class:`ControlError` if it does not arrive within ``timeout_s``,
        the peer closed, or the bytes are not a well-formed frame."""
        deadline = time.monotonic() + timeout_s
        (size,) = _LEN.unpack(self._read(_LEN.size, deadline))
        if size > max_header:
            raise ControlError(f"{self.peer} sent a {size}-byte header (limit {max_header}): not our protocol")
        try:
            header = json.loads(self._read(size, deadline))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ControlError(f"{self.peer} sent a frame that is not JSON: not our protocol") from exc
        sizes = header.pop("blobs", []) if isinstance(header, dict) else None
        kind = header.get("kind") if isinstance(header, dict) else None
        if (
            not isinstance(kind, str)
            or not isinstance(sizes, list)
            or not all(isinstance(n, int) and 0 <= n <= MAX_BLOB_BYTES for n in sizes)
        ):
            raise ControlError(f"{self.peer} sent a malformed frame: not our protocol")
        header.pop("kind")
        return Message(kind, from_wire(header), [self._read(n, deadline) for n in sizes])

    def _read(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlError(f"{self.peer} did not answer in time")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError:
                raise ControlError(f"{self.peer} did not answer in time") from None
            except OSError as exc:
                raise ControlError(f"{self.peer} went away ({exc})") from exc
            if not chunk:
                raise ControlError(f"{self.peer} closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _mac(key: bytes, role: bytes, challenge: bytes) -> str:
    return hmac.new(key, role + challenge, hashlib.sha256).hexdigest()


def _expect(ch: Channel, kind: str, deadline: float) -> Message:
    msg = ch.recv(max(0.0, deadline - time.monotonic()), max_header=_HANDSHAKE_HEADER_BYTES)
    if msg.kind == "refused":
        raise ControlError(f"{ch.peer} refused the connection: {msg.fields.get('reason', '')}")
    if msg.kind != kind:
        raise ControlError(f"{ch.peer} sent {msg.kind!r} during the handshake, expected {kind!r}")
    return msg


def _hex(msg: Message, key: str) -> bytes:
    value = msg[key]
    try:
        return bytes.fromhex(value)
    except (TypeError, ValueError):
        raise ControlError(f"bad {key!r} in the handshake") from None


def _server_handshake(ch: Channel, key: bytes, deadline: float) -> None:
    mine = secrets.token_bytes(32)
    ch.send("hello", protocol=PROTOCOL, challenge=mine.hex())
    msg = _expect(ch, "auth", deadline)
    if msg.fields.get("protocol") != PROTOCOL:
        ch.send("refused", reason=f"protocol {msg.fields.get('protocol')!r}, this engine speaks {PROTOCOL}")
        raise ControlError(f"{ch.peer} speaks protocol {msg.fields.get('protocol')!r}")
    if not hmac.compare_digest(msg["response"], _mac(key, b"client", mine)):
        ch.send("refused", reason=f"wrong key (set the same {KEY_ENV} or authkey on both sides)")
        raise ControlError(f"{ch.peer} failed authentication (wrong key)")
    ch.send("welcome", response=_mac(key, b"server", _hex(msg, "challenge")))


def _client_handshake(ch: Channel, key: bytes, deadline: float) -> None:
    hello = _expect(ch, "hello", deadline)
    if hello.fields.get("protocol") != PROTOCOL:
        raise ControlError(f"{ch.peer} speaks protocol {hello.fields.get('protocol')!r}, we speak {PROTOCOL}")
    mine = secrets.token_bytes(32)
    ch.send("auth", protocol=PROTOCOL, response=_mac(key, b"client", _hex(hello, "challenge")), challenge=mine.hex())
    welcome = _expect(ch, "welcome", deadline)
    if not hmac.compare_digest(welcome["response"], _mac(key, b"server", mine)):
        raise ControlError(f"{ch.peer} failed authentication (it does not know our key)")


def connect(address: str, *, timeout_s: float, key: bytes | str | None = None, what: str = "engine") -> Channel:
    """An authenticated channel to the listener at ``address``. Retries a refused
    connection (the engine may still be starting) until ``timeout_s``, saying so
    after a few seconds; every step of the handshake shares the same deadline."""
    host, port = parse_address(address, f"the {what}'s address")
    deadline = time.monotonic() + timeout_s
    warned = False
    start = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(left, 10.0)))
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ControlError(
                    f"nothing is listening at {address} after {timeout_s:g}s ({exc}); is the {what} "
                    "running? Start it first (weight_export.serve) or fix the address"
                ) from exc
            if not warned and time.monotonic() - start > _WARN_AFTER_S:
                log.warning(
                    "nothing is listening at %s yet (%s); is the %s running? waiting up to %gs",
                    address,
                    exc,
                    what,
                    timeout_s,
                )
                warned = True
            time.sleep(0.1)
    ch = Channel(sock, f"the {what} at {address}")
    try:
        _client_handshake(ch, resolve_key(address, key), deadline)
    except BaseException:
        ch.close()
        raise
    return ch


def listen_socket(host: str, port: int, backlog: int = socket.SOMAXCONN) -> socket.socket:
    """A TCP socket listening on ``host``'s address only (the first that ``getaddrinfo`` gives,
    resolved once; no wildcard unless ``host`` is one). ``OSError`` if it cannot bind."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class Listener:
    """Listens on exactly ``address`` (host resolved once; no wildcard) and hands out
    authenticated channels. Connections that fail the handshake are logged and dropped."""

    def __init__(self, address: str, *, key: bytes | str | None = None, what: str = "trainer"):
        host, port = parse_address(address, "the listen address")
        self.address, self.what = address, what
        self.key = resolve_key(address, key, create=True)
        try:
            self.sock = listen_socket(host, port, backlog=8)
        except OSError as exc:
            raise ControlError(f"cannot listen at {address} ({exc}); is another engine using that port?") from exc
        self.rejected = 0  # connections that failed the handshake

    def accept(self, timeout_s: float, *, handshake_s: float = 10.0) -> Channel:
        """The next connection that authenticates, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise ControlError(f"no {self.what} connected to {self.address} within {timeout_s:g}s")
            try:
                sock, peer = self.sock.accept()
            except OSError:
                continue
            ch = Channel(sock, f"the {self.what} at {peer[0]}:{peer[1]}")
            try:
                _server_handshake(ch, self.key, time.monotonic() + min(handshake_s, max(left, 0.1)))
                return ch
            except ControlError as exc:
                self.rejected += 1
                log.warning(
                    "control channel at %s: dropped a connection from %s:%s (%s)", self.address, peer[0], peer[1], exc
                )
                ch.close()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
