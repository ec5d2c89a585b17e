"""What every engine adapter shares: the engine's calls, the broadcast group, back-to-back packing.

An adapter is a sender of the export hook (:mod:`...transports`: ``allocate`` /
``start`` / ``send`` / ``finish`` / ``abort`` / ``close``) that speaks an
engine's own weight-update protocol instead of :func:`~...transports.serve.serve`'s:

- **The engine's calls** go through a callable the user supplies,
  ``call(method, *args, **kwargs)`` (an HTTP POST, ``llm.collective_rpc``, a
  Ray actor method...). :class:`EngineCalls` runs them one at a time, in order,
  on one worker thread: a call that blocks in the engine's receive (the engine
  joins the broadcast the trainer sends) runs while the trainer broadcasts, and
  the engine never sees two calls at once or out of order. Every wait on a call
  is bounded; its error names the engine and the method.
- **The broadcast group**: the trainer is rank 0 of a group the engine's ranks
  join at ``rank_offset=1``; the bytes go out with one ``broadcast`` from rank 0.
  :class:`TorchGroup` wraps a ``torch.distributed`` process group (gloo, NCCL),
  :class:`PyNcclGroup` vLLM's ``PyNcclCommunicator``. A broadcast's wait polls
  the engine call it belongs to, so an engine that refuses a request before it
  receives anything fails the trainer at once instead of after the group's
  timeout.
- **Back-to-back packing**: the engines' packed / flattened buckets hold the
  tensors back to back (no padding) in the order the request lists them; the
  export plan puts each tensor at a 256-byte aligned offset. :class:`Packer`
  hands out the export buffer itself when the two layouts agree (every tensor
  but the last a multiple of 256 bytes, as in most real models) and otherwise
  copies the tensors into a staging buffer (at most one bucket per export slot).

After a failed call or broadcast the group's collectives are out of step: the
adapter refuses further versions (:class:`ReceiverError` saying to rebuild it
and re-initialise the engine's group). Adapters without a group (vLLM's ``ipc``
backend) refuse them too: the engine may hold a partly written version.

**Closing never tears down the trainer's end of an NCCL group alone.** NCCL's
teardown of one end (``ncclCommDestroy``, and ``ncclCommAbort`` where cuMem host
memory is unavailable, e.g. in containers) joins its proxy thread, which serves
the peer ranks' connections until they close them, i.e. until the engine tears
down its end too: destroying ours alone blocks until the engine process exits
(gloo's teardown is local, so only NCCL shows it). ``close()`` therefore either
forgets the group (the default; vLLM's trainer-side ``PyNcclCommunicator`` is
never destroyed either) or, where the engine has a call for it (SGLang's
``destroy_weights_update_group``), destroys both ends together
(:meth:`EngineSender._release_with`).
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ....copies import copy_all
from ...plan.errors import ReceiverError
from ...plan.export_plan import BucketMeta, ExportPlan, TensorMeta

__all__ = [
    "EngineCall",
    "EngineCalls",
    "EngineSender",
    "Packer",
    "PyNcclGroup",
    "TorchGroup",
    "aligned_requests",
    "as_call",
    "dtype_str",
    "expect_version",
    "free_port",
    "packed_runs",
    "region",
    "tcp_url",
    "threshold_chunks",
]

log = logging.getLogger(__name__)

EngineCall = Callable[..., Any]
_POLL_MAX_S = 0.01  # longest sleep between two looks at a broadcast and its engine call
_GRACE_S = 5.0  # after a broadcast failed: how long to wait for the engine call's own (better) error


def as_call(engine) -> EngineCall:
    """``engine`` as ``call(method, *args, **kwargs)``: a callable is used as is; an object
    (e.g. vLLM's ``HTTPVLLMWeightSyncClient``, an SGLang ``Engine``) has its methods called."""
    if callable(engine):
        return engine
    if engine is None:
        raise ValueError("call must be a callable call(method, *args, **kwargs) or an object with the engine's methods")

    def call(method: str, *args, **kwargs):
        try:
            fn = getattr(engine, method)
        except AttributeError:
            raise ReceiverError(f"{type(engine).__name__} has no method {method!r}; pass call=... instead") from None
        return fn(*args, **kwargs)

    return call


def dtype_str(dtype: torch.dtype) -> str:
    """The dtype as both engines spell it on the wire (``getattr(torch, name)`` on their side)."""
    return str(dtype).removeprefix("torch.")


def tcp_url(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed (a torch rendezvous URL)."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (the group's rendezvous port, hosted by the trainer)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def packed_runs(tensors: Sequence[TensorMeta]) -> bool:
    """Whether ``tensors`` (in this order) already lie back to back in the bucket buffer."""
    return all(b.offset == a.offset + a.nbytes for a, b in zip(tensors, tensors[1:]))


def threshold_chunks(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """vLLM's packed-broadcast chunks, as ``(first, end)`` tensor index ranges: tensors are
    added to a chunk until its byte count *exceeds* ``limit`` (the tensor that crosses it is
    the chunk's last), and whatever remains at the end is the last chunk."""
    chunks, first, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > limit:
            chunks.append((first, i + 1))
            first, total = i + 1, 0
    if first < len(sizes):
        chunks.append((first, len(sizes)))
    return chunks


REGION_ALIGN = 16  # where each packed request starts in a staging buffer (typed views need an aligned start)


def region(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`REGION_ALIGN`: the staging space one packed request takes."""
    return -(-nbytes // REGION_ALIGN) * REGION_ALIGN


def aligned_requests(tensors: Sequence[TensorMeta], limit: int | None = None) -> list[list[TensorMeta]]:
    """``tensors`` split into consecutive requests whose packed layout the engine can unpack.

    Both engines rebuild each tensor as a dtype view of its bytes in the packed buffer (vLLM's
    ``unpack_tensor``: ``split`` then ``.contiguous().view(dtype)``; SGLang's
    ``FlattenedTensorBucket.reconstruct_tensors``: ``view(dtype)``), which torch allows only at a
    byte offset that is a multiple of the dtype's size. A tensor that would start at another
    offset starts a new request instead (offsets restart at 0). ``limit``: vLLM's packed chunk
    size (offsets also restart with every chunk, :func:`threshold_chunks`); None: one chunk."""
    requests: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    offset = 0  # of the next tensor in the current chunk
    for t in tensors:
        if current and offset % t.dtype.itemsize:
            requests.append(current)
            current, offset = [], 0
        current.append(t)
        offset += t.nbytes
        if limit is not None and offset > limit:
            offset = 0
    if current:
        requests.append(current)
    return requests


class Packer:
    """Back-to-back bytes of a bucket's tensors: a view of the export buffer when the plan's
    aligned layout already is back to back, else a copy into this slot's staging buffer."""

    def __init__(self):
        self._staging: dict[int, torch.Tensor] = {}
        self.copies = 0  # tensors copied into staging (0 when every bucket went out zero-copy)

    def pack(
        self, tensors: Sequence[TensorMeta], buf: torch.Tensor, slot: int, *, at: int = 0, copy: bool = False
    ) -> torch.Tensor:
        """The packed bytes (uint8) of ``tensors`` from ``buf``; staged at byte ``at`` of slot
        ``slot``'s staging buffer when a copy is needed (or ``copy``)."""
        total = sum(t.nbytes for t in tensors)
        if not tensors:
            return buf[:0]
        if not copy and packed_runs(tensors):
            return buf[tensors[0].offset : tensors[0].offset + total]
        stage = self._staging.get(slot)
        if stage is None or stage.device != buf.device or stage.numel() < at + total:
            # A new buffer: views handed out from the old one keep it alive until their broadcasts are done.
            size = max(at + total, 0 if stage is None else stage.numel())
            stage = self._staging[slot] = torch.empty(size, dtype=torch.uint8, device=buf.device)
        out, pos, pairs = stage[at : at + total], 0, []
        for t in tensors:
            pairs.append((out[pos : pos + t.nbytes], buf[t.offset : t.offset + t.nbytes]))
            pos += t.nbytes
        copy_all(pairs)
        self.copies += len(tensors)
        return out

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self._staging.values())


# ---------------------------------------------------------------------------------------- groups
class TorchGroup:
    """A ``torch.distributed`` process group (or backend) the trainer joined as rank 0. ``close()``
    forgets it; ``destroy()`` destroys this process's end (a registered group: ``destroy_process_group``),
    which on NCCL returns only once the engine's end is being destroyed too (see the module docstring)."""

    def __init__(self, pg):
        self.pg = pg

    def broadcast(self, tensor: torch.Tensor):
        work = self.pg.broadcast(tensor, 0)
        return work.is_completed, work.wait

    def destroy(self) -> None:
        import torch.distributed as dist

        pg, self.pg = self.pg, None
        if pg is not None:
            dist.destroy_process_group(pg)

    def close(self) -> None:
        self.pg = None


class PyNcclGroup:
    """vLLM's ``PyNcclCommunicator`` (the trainer is rank 0): broadcasts are enqueued on the
    current CUDA stream; one is done when an event recorded after it has completed."""

    def __init__(self, comm):
        self.comm = comm

    def broadcast(self, tensor: torch.Tensor):
        stream = torch.cuda.current_stream(tensor.device)
        self.comm.broadcast(tensor, src=0, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event.query, event.synchronize

    def close(self) -> None:
        self.comm = None


# ---------------------------------------------------------------------------------- engine calls
class EngineCalls:
    """The user's ``call`` run one at a time, in submission order, on one worker thread.

    ``check(method, result)`` turns a result that reports failure (SGLang answers
    ``{"success": false, "message": ...}``) into an exception."""

    def __init__(self, call: EngineCall, *, what: str, timeout_s: float, check=None):
        self.call, self.what, self.timeout_s, self.check = as_call(call), what, timeout_s, check
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-call")

    def submit(self, method: str, *args, **kwargs) -> concurrent.futures.Future:
        def run():
            result = self.call(method, *args, **kwargs)
            if self.check is not None:
                self.check(method, result)
            return result

        fut = self._pool.submit(run)
        fut.method = method
        return fut

    def error(self, fut: concurrent.futures.Future) -> ReceiverError:
        exc = fut.exception()
        if isinstance(exc, ReceiverError):
            return exc
        return ReceiverError(f"{self.what}: {fut.method} failed: {type(exc).__name__}: {exc}")

    def wait(self, fut: concurrent.futures.Future, timeout_s: float | None = None):
        """The call's result; ReceiverError when it raised or did not return in time."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise ReceiverError(
                f"{self.what} did not answer {fut.method} within {timeout_s:g}s; check that the engine is up and "
                "that it reaches the trainer's group address (see the engine's log), then rebuild the adapter"
            ) from None
        except Exception:  # noqa: BLE001 - reported as the engine's error below
            raise self.error(fut) from fut.exception()
        return fut.result()

    def run(self, method: str, *args, **kwargs):
        return self.wait(self.submit(method, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Pending:
    """One bucket on its way: its broadcasts and the engine calls that receive them. ``keep``: what
    must stay alive until the engine acknowledged them (e.g. the storage its IPC handles name)."""

    def __init__(self, sender: EngineSender, bucket: BucketMeta, works=(), futures=(), keep=()):
        self.sender, self.bucket, self.works, self.futures = sender, bucket, list(works), list(futures)
        self.keep = keep
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        s = self.sender
        try:
            for is_done, wait in self.works:
                s._await_work(is_done, wait, self.futures, self.bucket.index)
            for fut in self.futures:
                s.calls.wait(fut)
        except ReceiverError as exc:
            s.broken = s.broken or "a bucket failed"
            names = [t.name for t in self.bucket.tensors]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise ReceiverError(f"{exc} [bucket {self.bucket.index}: {shown}]") from exc
        except BaseException:
            s.broken = s.broken or "a bucket failed"
            raise
        self.done = True
        self.keep = ()


class EngineSender:
    """The sender protocol over an engine's own calls (subclasses: one per protocol).

    Subclasses implement ``_connect()`` (once, at the first :meth:`start`),
    ``_begin(version)``, ``_send(bucket, buf, slot) -> _Pending`` and
    ``_finish(version) -> applied version``."""

    what = "the engine"
    # why a sender that failed refuses further versions, and what to do (see _check_usable)
    after_failure = (
        "the engine's weight update group is out of step; close it, build a new adapter (a new group port/name) "
        "and let the engine join again"
    )

    def __init__(self, call: EngineCall, *, timeout_s: float = 120.0, check=None):
        number = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
        if not (number and 0 < timeout_s < float("inf")):
            raise ValueError(f"timeout_s must be > 0 and finite (seconds), got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.calls = EngineCalls(call, what=self.what, timeout_s=self.timeout_s, check=check)
        self.packer = Packer()
        self.group = None
        self.device: torch.device | None = None
        self.plan: ExportPlan | None = None
        self.connected = False
        self.broken: str | None = None
        self.release_error: str | None = None  # why close() could not release the group with the engine
        self._pending: list[_Pending] = []

    # ----------------------------------------------------------------- sender protocol
    def allocate(self, nbytes: int, device) -> torch.Tensor:
        self.device = torch.device(device)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def connect(self) -> None:
        """Set up the engine's side once (e.g. its weight-update group); :meth:`start` does it
        at the first version if it was not called."""
        self._check_usable()
        if not self.connected:
            try:
                self._connect()
            except BaseException:
                self.broken = "its set-up failed"
                raise
            self.connected = True

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if self.device is None and buffers:
            self.device = buffers[0].device
        self.connect()
        self.plan = plan
        self._pending = []
        self._begin(version)

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        self._check_usable()
        pending = self._send(bucket, buf, bucket.index % 2)
        self._pending.append(pending)
        return pending

    def finish(self, version: int) -> list[int]:
        self._settle()
        self._pending = []
        return [self._finish(version)]

    def _settle(self) -> None:
        """Wait until every bucket sent so far has arrived (before a request that publishes the version)."""
        for p in self._pending:
            p.wait()

    def abort(self, version: int) -> list[None]:
        """The version will not complete. The engines write as buckets arrive, so each holds a
        partly written model: none holds a complete version (None)."""
        self._pending = []
        return [None]

    def close(self) -> None:
        """Let go of the group (:meth:`_release_group`, which may need an engine call), then of the call thread."""
        group, self.group = self.group, None
        try:
            if group is not None:
                self._release_group(group)
        finally:
            self.calls.close()

    # ----------------------------------------------------------------- helpers
    def _release_group(self, group) -> None:
        """At ``close()``: forget the group, leaving its ends up until the processes exit (tearing down
        ours alone would block on NCCL until the engine's end goes; see the module docstring)."""
        group.close()

    def _release_with(self, group, method: str, **kwargs) -> None:
        """Destroy both ends of ``group`` together: the engine's through its call ``method`` (submitted
        first), this process's end meanwhile on a helper thread (on NCCL each end's teardown returns only
        once the other end is being torn down too). Each wait is bounded by ``timeout_s``. ``close()``
        does not raise: a failure is logged and kept in :attr:`release_error`; this process's end is then
        left to the helper thread, which finishes once the engine's end goes (e.g. the engine exits)."""
        fut = self.calls.submit(method, **kwargs)
        done, failed = threading.Event(), []

        def destroy():
            try:
                group.destroy()
            except BaseException as exc:  # noqa: BLE001 - reported by the waiting thread
                failed.append(exc)
            finally:
                done.set()

        # A daemon thread, not a pool's: a teardown the engine never matches must not hold up the process's exit.
        threading.Thread(target=destroy, name="group-release", daemon=True).start()
        problem = None
        try:
            self.calls.wait(fut)
        except ReceiverError as exc:
            problem = f"{exc}; this process's end of the group is left to a background thread"
        if problem is None:
            if not done.wait(self.timeout_s):
                problem = f"this process's end of the group was not destroyed within {self.timeout_s:g}s"
            elif failed:
                problem = f"destroying this process's end of the group failed: {type(failed[0]).__name__}: {failed[0]}"
        self.release_error = problem
        if problem is not None:
            log.warning("%s: releasing the weight update group at close: %s", self.what, problem)

    def _check_usable(self) -> None:
        if self.broken:
            raise ReceiverError(
                f"this {type(self).__name__} cannot send another version: {self.broken}, so {self.after_failure}"
            )

    def _watch(self, is_done: Callable[[], bool], futures, timeout_error: str) -> None:
        """Wait until ``is_done()``, bounded by ``timeout_s`` (then ReceiverError ``timeout_error``); an engine
        call of ``futures`` that fails ends the wait at once with the engine's error."""
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-4
        while not is_done():
            for fut in futures:
                if fut.done() and fut.exception() is not None:
                    raise self.calls.error(fut)
            if time.monotonic() > deadline:
                raise ReceiverError(timeout_error)
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def _await_work(self, is_done, wait, futures, index: int) -> None:
        """Wait for one broadcast, watching the engine calls that receive it (:meth:`_watch`); a broadcast
        that fails reports the engine's error if the engine had one, else its own."""
        self._watch(
            is_done,
            futures,
            f"{self.what} did not receive bucket {index} within {self.timeout_s:g}s (the broadcast is still "
            "pending; with NCCL it cannot be cancelled: restart this process before refitting again)",
        )
        try:
            wait()
        except Exception as exc:  # gloo: the peer is gone or timed out
            for fut in futures:
                try:
                    fut.exception(timeout=_GRACE_S)
                except concurrent.futures.TimeoutError:
                    continue
                if fut.exception() is not None:
                    raise self.calls.error(fut) from exc
            raise ReceiverError(f"broadcast of bucket {index} to {self.what} failed ({exc})") from exc

    def _join(self, init_fut: concurrent.futures.Future, join: Callable[[], Any]):
        """Run ``join()`` (the trainer's side of the group rendezvous) while the engine's init call
        ``init_fut`` is in flight; fail as soon as either fails. Returns ``join()``'s result."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="group-join")
        try:
            joined = pool.submit(join)
            self._watch(
                joined.done,
                [init_fut],
                f"{self.what} did not join the weight update group within {self.timeout_s:g}s; check that it "
                "can reach the master address and port, and that its rank count (engine_ranks) is right",
            )
            try:
                group = joined.result()
            except Exception as exc:
                if init_fut.done() and init_fut.exception() is not None:
                    raise self.calls.error(init_fut) from exc
                raise ReceiverError(f"joining {self.what}'s weight update group failed: {exc}") from exc
            self.calls.wait(init_fut)
            return group
        finally:
            pool.shutdown(wait=False)

    def _set_master(self, master_address, master_port) -> None:
        """The group's rendezvous (hosted by the trainer): its address the engine reaches, and the port."""
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address must be the trainer's address the engine reaches, got {master_address!r}")
        self.master_address = master_address
        self.master_port = check_int("master_port (0: pick a free one)", master_port, 0)
        if self.master_port > 65535:
            raise ValueError(f"master_port must be in 0..65535, got {master_port}")

    def _port(self) -> int:
        """The rendezvous port; 0 given: a free one, picked at the first call."""
        if self.master_port == 0:
            self.master_port = free_port(self.master_address)
        return self.master_port

    def _connect(self) -> None:
        pass

    def _begin(self, version: int) -> None:
        pass

    def _send(self, bucket: BucketMeta, buf: torch.Tensor, slot: int) -> _Pending:
        raise NotImplementedError

    def _finish(self, version: int) -> int:
        return version


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; ValueError naming the argument otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_choice(name: str, value, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def expect_version(sender: EngineSender, reported, version: int) -> None:
    """``reported`` (the engine's ``get_weight_version`` answer: a string, a dict with
    ``weight_version``, or a list of those from several engine ranks) must be ``version``."""
    if isinstance(reported, dict):
        reported = reported.get("weight_version")
    values = reported if isinstance(reported, (list, tuple)) else [reported]
    values = [v.get("weight_version") if isinstance(v, dict) else v for v in values]
    if not values or any(str(v) != str(version) for v in values):
        sender.broken = sender.broken or "the engine reported another weight version"
        raise ReceiverError(f"{sender.what} reports weight version {reported!r} after version {version} was sent")
