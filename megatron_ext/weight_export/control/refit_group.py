"""A process group for reshard refit that spans two jobs: a Megatron trainer and a separate inference engine.

Each job keeps its own default ``torch.distributed`` world. :meth:`RefitGroup.join`
builds one more group outside both worlds, over the refit's own store
(:mod:`.store`: the control channel's authenticated frames), like the
``broadcast`` transport's (:func:`make_group`): refit rank 0 hosts the store; by
convention the trainer's ranks are refit ranks ``0..T-1`` and the engine's
``T..T+E-1`` (the layouts' ``ranks`` say which is which). Plans and
:class:`~..exec.reshard.ReshardExecutor` use refit ranks; pass ``group=refit_group``.

Every wait is bounded by ``timeout_s`` and fails with :class:`RefitGroupError`
naming the refit ranks that did not arrive, so a missing job is an error, not a
hang. Refit rank 0's store listens only on the address it is given (``host``,
resolved once) and admits only clients that know the key
(:func:`~.channel.resolve_key`: ``authkey``, ``$MEGATRON_EXT_EXPORT_AUTHKEY``,
or on loopback this user's key file); a health check, a port scan or garbage
bytes are dropped without disturbing the group. The store also carries the
small control messages of :mod:`~..refit` (plan fingerprints, announced
versions, acknowledgements): strings and integers only, nothing is unpickled.

Point-to-point: gloo ``send`` / ``recv`` on the backend object; NCCL batched
between the backend's coalescing calls, as ``torch.distributed.batch_isend_irecv``
does for a registered group (:func:`~.peers.nccl_coalesced`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..plan.errors import RefitGroupError
from .channel import ControlError, resolve_key
from .peers import NOTE_BYTES, Peers, cut_note, nccl_coalesced
from .store import ControlStore, host_store

__all__ = ["NOTE_BYTES", "RefitGroup", "RefitGroupError", "make_group"]


def _missing(store, keys: list[str], ranks) -> list[int]:
    return [r for r, k in zip(ranks, keys) if not store.check([k])]


def make_group(store, rank: int, world: int, backend: str, timeout_s: float):
    """A process group over ``store`` outside the default world (trainer + engines only): the
    refit group's and the ``broadcast`` transport's."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = dist.PrefixStore("megatron_ext_weight_export", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefix, rank, world, opts)


class RefitGroup(Peers):
    """Refit ranks of a trainer job and an engine job in one group. Build it with :meth:`join`.

    ``store`` is a namespaced view of the group's store (:mod:`.store`; control messages);
    ``pg`` the gloo or NCCL backend object that moves the bytes. As the reshard executor's
    :class:`~.peers.Peers`, its ranks are refit ranks.
    """

    word = "refit rank"

    def __init__(
        self,
        store,
        pg,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
        address: str,
        base_store=None,
    ):
        self.store, self.pg, self.rank, self.world_size = store, pg, rank, world_size
        self.backend, self.device, self.timeout_s, self.address = backend, device, timeout_s, address
        self._base_store = base_store  # the connection (and on refit rank 0 the server) under ``store``
        self._counters: dict[str, int] = {}

    # ------------------------------------------------------------------ joining
    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        timeout_s: float = 120.0,
        name: str = "refit",
        authkey: bytes | str | None = None,
    ) -> "RefitGroup":
        """Join refit group ``name`` at ``host:port`` as refit rank ``rank`` of ``world_size``.

        Refit rank 0 hosts the store at ``port`` (pick a port neither job's
        default world uses), listening on ``host``'s address only: give the
        address the other job reaches it at (``127.0.0.1`` when both jobs share
        the machine), not a wildcard. Every rank of both jobs calls this; it
        returns once all ``world_size`` ranks joined with the same ``world_size`` and
        ``backend``, and raises :class:`RefitGroupError` after ``timeout_s``
        naming the ranks that did not. ``device``: where the refit's buffers
        live (NCCL: this rank's GPU, default the current one; gloo: CPU).
        ``authkey``: the store's shared secret (every rank of both jobs the same);
        by default ``$MEGATRON_EXT_EXPORT_AUTHKEY``, or on a loopback address this
        user's key file. Off loopback a key is required.
        """
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        device = torch.device(device)
        if backend == "nccl":
            if device.type != "cuda":
                raise ValueError(f"backend 'nccl' needs a CUDA device, got {device}")
            torch.cuda.set_device(device)  # NCCL's batched P2P needs the current device set
        address = f"{host}:{port}"
        key = resolve_key(address, authkey, create=True)  # loopback: this user's key file, made by whoever is first
        try:
            if rank == 0:  # serve the store on the one address asked for
                base = host_store(host, port, key, timeout_s)
            else:
                base = ControlStore(address, key, timeout_s)
        except OSError as exc:
            raise RefitGroupError(
                f"refit rank 0 could not host the refit group's store at {address} (port in use, or {host} "
                f"is not an address of this machine?) ({exc})"
            ) from exc
        except ControlError as exc:
            raise RefitGroupError(
                f"refit rank {rank} could not reach the refit group's store at {address} within {timeout_s:g}s: "
                f"refit rank 0 (the trainer's first rank) hosts it; is that job up? ({exc})"
            ) from exc
        store = dist.PrefixStore(f"megatron_ext_refit/{name}", base)
        group = cls(store, None, rank, world_size, backend, device, timeout_s, address, base_store=base)
        if store.add(f"seat/{rank}", 1) > 1:
            raise RefitGroupError(
                f"refit rank {rank} joined {address} twice: give every rank of both jobs its own "
                f"refit rank (trainer 0..T-1, engine T..T+E-1)"
            )
        store.set(f"join/{rank}", f"{world_size} {backend}")
        group.arrive("join", what=f"join the refit group at {address}")
        mine = f"{world_size} {backend}"
        peers = range(world_size) if rank == 0 else [0]
        values = store.multi_get([f"join/{r}" for r in peers])
        odd = [(r, v.decode()) for r, v in zip(peers, values) if v.decode() != mine]
        if odd:
            raise RefitGroupError(
                f"refit rank {rank} joined {address} with world_size/backend '{mine}', but "
                + ", ".join(f"rank {r} with '{v}'" for r, v in odd)
            )
        group.pg = make_group(store, rank, world_size, backend, timeout_s)
        return group

    # ------------------------------------------------------------------ control
    def next_tag(self, kind: str) -> str:
        """A store key prefix unique to this call, the same on every rank that calls in the same order."""
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        return f"{kind}/{n}"

    def wait_keys(self, keys: list[str], ranks, *, what: str, timeout_s: float | None = None) -> None:
        """Wait until every key exists (``keys[i]`` is set by refit rank ``ranks[i]``); on
        timeout raise :class:`RefitGroupError` naming the ranks whose key is missing."""
        self._wait(keys, what, timeout_s, lambda: _missing(self.store, keys, ranks))

    def arrive(self, kind: str, *, what: str, timeout_s: float | None = None) -> None:
        """Every rank arrives at the same point (through the store, bounded by the timeout)."""
        tag = self.next_tag(kind)
        self.store.set(f"{tag}/{self.rank}", "1")
        if self.store.add(f"{tag}/n", 1) == self.world_size:
            self.store.set(f"{tag}/all", "1")
        ranks = range(self.world_size)
        self._wait([f"{tag}/all"], what, timeout_s, lambda: _missing(self.store, [f"{tag}/{r}" for r in ranks], ranks))

    def _wait(self, keys, what, timeout_s, missing) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait(keys, datetime.timedelta(seconds=t))
            return
        except (RuntimeError, dist.DistError) as exc:
            err = exc
        try:
            absent = missing()
        except (RuntimeError, dist.DistError):
            raise RefitGroupError(
                f"refit rank {self.rank}: lost the refit group's store at {self.address} while "
                f"waiting to {what}; did refit rank 0 (the trainer's first rank) exit?"
            ) from err
        raise RefitGroupError(
            f"refit rank {self.rank}: refit ranks {absent} did not {what} within {t:g}s (group "
            f"at {self.address}, {self.world_size} ranks); is the other job running and calling "
            "the same refit steps?"
        ) from err

    def gather_notes(self, value: int, note: str, device=None, *, what: str) -> list[tuple[int, str]]:
        """Every refit rank's ``(value, note)``, in refit-rank order (through the store, bounded); a note is
        a short text (cut at :data:`NOTE_BYTES`), e.g. why a rank cannot take part."""
        tag = self.next_tag("gather")
        self.store.set(f"{tag}/{self.rank}", f"{int(value)} {cut_note(note)}")
        keys = [f"{tag}/{r}" for r in range(self.world_size)]
        self.wait_keys(keys, range(self.world_size), what=what)
        out = []
        for raw in self.store.multi_get(keys):
            v, _, n = raw.decode(errors="replace").partition(" ")
            out.append((int(v), n))
        return out

    def start(self) -> None:
        """On NCCL, one all-reduce creates the communicator on every rank, which PyTorch asks for
        before the first batch of point-to-point ops (call it after every rank arrived)."""
        if self.backend == "nccl":
            self.pg.allreduce([torch.zeros(1, device=self.device)]).wait()

    # ------------------------------------------------------------ point-to-point
    def post(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """Post ``("send" | "recv", tensor, peer refit rank)`` ops; returns waitable requests."""
        if self.backend == "nccl":
            return [_Request(w, self, "the batched sends/receives") for w in nccl_coalesced(self.pg, ops)]
        out = []
        for kind, t, peer in ops:
            work = self.pg.send([t], peer, 0) if kind == "send" else self.pg.recv([t], peer, 0)
            out.append(_Request(work, self, f"{kind} {'to' if kind == 'send' else 'from'} refit rank {peer}"))
        return out

    def sum(self, value: torch.Tensor) -> int:
        t = value.to(self.device, copy=True)
        _Request(self.pg.allreduce([t]), self, "the refit's all-reduce").wait()
        return int(t.item())

    def close(self) -> None:
        """Shut the backend down (NCCL frees its communicator) and drop this rank's store references (on
        refit rank 0 the store's server stops with the last one). To recover from a failure, every rank
        closes its group and joins again."""
        if self.pg is not None and hasattr(self.pg, "shutdown"):
            try:
                self.pg.shutdown()
            except RuntimeError:
                pass
        if self._base_store is not None:
            self._base_store.close()
        self.pg = self.store = self._base_store = None


class _Request:
    def __init__(self, work, group: RefitGroup, what: str):
        self.work, self.group, self.what = work, group, what

    def wait(self):
        try:
            self.work.wait()
        except Exception as exc:  # gloo: peer gone or timed out; NCCL: communicator error
            raise RefitGroupError(
                f"refit rank {self.group.rank}: {self.what} failed ({exc}); the peer died, did not take part "
                f"within {self.group.timeout_s:g}s, or cuts its buckets differently. Recreate the group "
                "(RefitGroup.join) once both jobs are back."
            ) from exc
        return True
