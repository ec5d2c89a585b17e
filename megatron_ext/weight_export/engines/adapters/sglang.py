"""SGLang's weight-update protocols, driven from the export hook (trainer side).

Two protocols, each a sender of :class:`~...exporter.WeightExporter`
(``WeightExporter(model, config, sender=adapter)``):

:class:`SglangDistributedSender` — ``init_weights_update_group`` once, then
``update_weights_from_distributed`` per bucket (SGLang's ``ModelRunner``,
``python/sglang/srt/model_executor/model_runner.py``)::

    init_weights_update_group(master_address, master_port, rank_offset=1, world_size, group_name, backend)
    update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache,
                                    load_format="flattened_bucket")                 # per bucket
    update_weight_version(new_version, abort_all_requests=False)                     # per version
    destroy_weights_update_group(group_name)                                         # at close()

Each TP rank of the engine joins ``init_custom_process_group(backend,
init_method="tcp://master_address:master_port", world_size, rank=rank_offset +
tp_rank, group_name)`` (a torch process group over a TCP store the trainer, rank
0, hosts); :func:`join_sglang_group` is the trainer's end of it. With
``load_format="flattened_bucket"`` (default) the engine allocates the listed
tensors, builds a ``FlattenedTensorBucket`` of them (their bytes back to back,
in the listed order, no padding) and receives it with one ``broadcast`` from
rank 0; without it (``flattened=False``) it receives one broadcast per tensor,
in order. ``flush_cache=True`` goes with the version's last request only. The
version is published at the end, once every bucket arrived and the export hook
accepted the version (its NaN/Inf check runs after the last bucket):
``update_weight_version(new_version, abort_all_requests=False)`` by default, or,
with ``publish_version="last_request"`` (SGLang versions without that call), as
``weight_version`` of the last request, sent only after every earlier one
succeeded.

``close()`` destroys the group's two ends together: the engine's with
``destroy_weights_update_group(group_name)`` while the trainer destroys its own
(on NCCL, tearing down one end alone blocks until the other end goes: see
:mod:`.base`); ``release_group=False`` (SGLang versions without that call)
leaves both ends up instead. The trainer's end is a fresh communicator over the
group's TCP store, never split from the trainer's default group (see
:func:`unbound_default_group`).

:class:`SglangTensorSender` — ``update_weights_from_tensor`` with
``load_format="flattened_bucket"``: no group; each bucket is one flattened
tensor plus its metadata (``name, shape, dtype, start_idx, end_idx, numel``),
pickled with ``ForkingPickler`` (CUDA tensors travel as CUDA IPC handles) and
base64-encoded, once per engine TP rank, as ``serialized_named_tensors``. For a
colocated engine on the trainer's GPU (same CUDA device numbering).

Flattened layout: SGLang versions with ``FlattenedTensorBucket.supports_multi_dtypes``
flatten every tensor to bytes (``start_idx``/``end_idx`` in bytes, mixed dtypes
in one bucket, a uint8 broadcast); older ones concatenate in the tensors' own
dtype (one dtype per bucket, indices in elements): pass ``group_by_dtype=True``
for those (one call per dtype in a bucket, typed broadcasts; also accepted by the
newer versions).

Wiring ``call(method, **kwargs)``: over HTTP, ``requests.post(f"{url}/{method}",
json=kwargs, timeout=...).json()`` (SGLang answers ``{"success": ..., "message":
...}``; a ``success: false`` is raised here with the engine's message), and
``get_weight_version`` as a GET for ``check_version``; in process, an
``sglang.Engine`` passed as ``call`` (its methods of these names; it answers
``(success, message)``), except ``update_weights_from_tensor``, which the Python
``Engine`` takes unserialized: use the HTTP route or the tokenizer manager's request.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import types

import torch

from ...plan.errors import ReceiverError
from ...plan.export_plan import BucketMeta, TensorMeta
from .base import (
    EngineCall,
    EngineSender,
    TorchGroup,
    _Pending,
    aligned_requests,
    check_choice,
    check_int,
    dtype_str,
    expect_version,
    region,
    tcp_url,
)

__all__ = [
    "PUBLISH_VERSION",
    "SglangDistributedSender",
    "SglangTensorSender",
    "join_sglang_group",
    "serialize",
    "unbound_default_group",
]

# How the version is published: an update_weight_version call at the end, the last request's
# weight_version field, or not at all.
PUBLISH_VERSION = ("update_weight_version", "last_request", "none")


@contextlib.contextmanager
def unbound_default_group():
    """While a group outside the default group is created: the default group looks bound to no device.

    torch (>= 2.3) builds a new NCCL group's communicator by ``ncclCommSplit`` of the default group's
    whenever the default group is bound to a device (``init_process_group(device_id=...)``, as
    Megatron's and our launchers do). That split is collective over the whole default group, whose
    other ranks never join a group of the trainer's rank 0 and the engine's ranks: rank 0 would
    block in it at the group's first broadcast. Unbound, the communicator is created from the
    group's own store instead. (torch's helper reads ``bound_device_id`` only while it runs.)"""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group() if dist.is_initialized() else None
    bound = None if default is None else default.bound_device_id
    if bound is not None:
        default.bound_device_id = None
    try:
        yield
    finally:
        if bound is not None:
            default.bound_device_id = bound


def join_sglang_group(
    master_address: str, master_port: int, world_size: int, group_name: str, backend: str, timeout_s: float
):
    """The trainer's end (rank 0) of SGLang's ``init_custom_process_group``: a torch rendezvous at
    ``tcp://master_address:master_port`` (rank 0 hosts the TCP store), the store prefixed with
    ``group_name``, a process group of ``backend`` named ``group_name`` whose group ranks are also
    the ranks ``broadcast`` takes, its communicator not split from the default group's
    (:func:`unbound_default_group`). Collective with the engine's ranks ``1..world_size-1``."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(tcp_url(master_address, master_port), 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    with unbound_default_group():
        pg, _ = c10d._new_process_group_helper(
            world, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def serialize(obj) -> str:
    """``obj`` as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` makes it:
    a ``ForkingPickler`` pickle (tensors shared, not copied), base64-encoded."""
    import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def _check_result(method: str, result) -> None:
    """SGLang reports a refusal as ``success: false`` (HTTP JSON) or ``(False, message)`` (Engine API)."""
    if isinstance(result, dict) and "success" in result:
        ok, message = result["success"], result.get("message", "")
    elif isinstance(result, (tuple, list)) and len(result) >= 2 and isinstance(result[0], bool):
        ok, message = result[0], result[1]
    else:
        return
    if not ok:
        raise ReceiverError(f"the SGLang engine refused {method}: {message}")


def _requests(tensors: tuple[TensorMeta, ...], by_dtype: bool, flattened: bool = True) -> list[list[TensorMeta]]:
    """The bucket's tensors as update requests: one per dtype (in order of first appearance) for
    single-dtype buckets; else as few as the engine can unpack (:func:`~.base.aligned_requests`)."""
    if not flattened:
        return [list(tensors)]
    if not by_dtype:
        return aligned_requests(tensors)
    groups: dict[torch.dtype, list[TensorMeta]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


class _SglangSender(EngineSender):
    what = "the SGLang engine"

    def __init__(
        self,
        call: EngineCall,
        *,
        engine_ranks: int = 1,
        group_by_dtype: bool = False,
        update_kwargs: dict | None = None,
        timeout_s: float = 120.0,
        check_version: bool = False,
        publish_version: str = "update_weight_version",
    ):
        super().__init__(call, timeout_s=timeout_s, check=_check_result)
        self.engine_ranks = check_int("engine_ranks (the engine's TP size)", engine_ranks, 1)
        self.group_by_dtype = bool(group_by_dtype)
        self.update_kwargs = dict(update_kwargs or {})
        own = {"names", "dtypes", "shapes", "group_name", "serialized_named_tensors", "load_format", "weight_version"}
        clash = own & set(self.update_kwargs)
        if clash:
            raise ValueError(f"update_kwargs must not set {sorted(clash)}: the adapter sets them")
        self.check_version = bool(check_version)
        self.publish_version = check_choice("publish_version", publish_version, PUBLISH_VERSION)
        self.version: int | None = None

    def _begin(self, version: int) -> None:
        self.version = version

    def _last(self, bucket: BucketMeta, group_index: int, groups: list, works=(), futures=()) -> dict:
        """``flush_cache`` (and, with ``publish_version="last_request"``, ``weight_version``) of one
        request: only the version's last one flushes the cache; it carries the version only once
        every earlier request succeeded (an engine that failed one never reports the version)."""
        last = bucket.index == self.plan.buckets[-1].index and group_index == len(groups) - 1
        fields = {"flush_cache": last}
        if last and self.publish_version == "last_request":
            self._settle()
            _Pending(self, bucket, works, futures).wait()  # this bucket's earlier requests
            fields["weight_version"] = str(self.version)
        return {**fields, **self.update_kwargs}

    def _finish(self, version: int) -> int:
        if self.publish_version == "update_weight_version":
            self.calls.run("update_weight_version", new_version=str(version), abort_all_requests=False)
        if self.check_version:
            expect_version(self, self.calls.run("get_weight_version"), version)
        return version


class SglangDistributedSender(_SglangSender):
    """``init_weights_update_group`` + ``update_weights_from_distributed`` (see the module docstring).

    ``master_address``: the trainer's address the engine's ranks reach (the trainer hosts the
    rendezvous store); ``master_port`` 0 picks a free port. ``engine_ranks``: the engine's TP size.
    ``group_name`` / ``backend`` as SGLang takes them (``"nccl"`` on GPUs, ``"gloo"`` on CPU).
    ``flattened``: one flattened broadcast per bucket (``load_format="flattened_bucket"``) or one
    per tensor. ``update_kwargs``: extra fields of every update request (e.g.
    ``abort_all_requests=True``). ``publish_version``: see the module docstring. ``check_version``:
    ask ``get_weight_version`` at the end and require the version just sent. ``engine_ranks``,
    ``group_by_dtype``, ``update_kwargs``, ``timeout_s``, ``check_version`` and ``publish_version``
    are :class:`SglangTensorSender`'s too. ``release_group``: ``close()`` destroys the group's two
    ends together (``destroy_weights_update_group``); False (SGLang versions without that call):
    both ends stay up until the processes exit (NCCL cannot tear down one end alone)."""

    def __init__(
        self,
        call: EngineCall,
        *,
        master_address: str,
        master_port: int = 0,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        flattened: bool = True,
        release_group: bool = True,
        **kwargs,
    ):
        super().__init__(call, **kwargs)
        self._set_master(master_address, master_port)
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"group_name must be a non-empty string, got {group_name!r}")
        if not isinstance(release_group, bool):
            raise ValueError(f"release_group must be True or False, got {release_group!r}")
        self.group_name = group_name
        self.backend = check_choice("backend", backend, ("nccl", "gloo"))
        self.flattened = bool(flattened)
        self.release_group = release_group
        self.world_size = 1 + self.engine_ranks

    def _connect(self) -> None:
        fut = self.calls.submit(
            "init_weights_update_group",
            master_address=self.master_address,
            master_port=self._port(),
            rank_offset=1,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
        )
        pg = self._join(
            fut,
            lambda: join_sglang_group(
                self.master_address, self.master_port, self.world_size, self.group_name, self.backend, self.timeout_s
            ),
        )
        self.group = TorchGroup(pg)

    def _release_group(self, group: TorchGroup) -> None:
        if self.release_group:
            self._release_with(group, "destroy_weights_update_group", group_name=self.group_name)
        else:
            group.close()

    def _send(self, bucket: BucketMeta, buf: torch.Tensor, slot: int) -> _Pending:
        works, futures, at = [], [], 0
        groups = _requests(bucket.tensors, self.group_by_dtype, self.flattened)
        for i, tensors in enumerate(groups):
            request = dict(
                names=[t.name for t in tensors],
                dtypes=[dtype_str(t.dtype) for t in tensors],
                shapes=[list(t.shape) for t in tensors],
                group_name=self.group_name,
                **self._last(bucket, i, groups, works, futures),
            )
            if self.flattened:
                request["load_format"] = "flattened_bucket"
            futures.append(self.calls.submit("update_weights_from_distributed", **request))
            if self.flattened:
                data = self.packer.pack(tensors, buf, slot, at=at)
                at += region(data.numel())
                works.append(self.group.broadcast(data.view(tensors[0].dtype) if self.group_by_dtype else data))
            else:
                works += [self.group.broadcast(t.view(buf)) for t in tensors]
        return _Pending(self, bucket, works, futures)


class SglangTensorSender(_SglangSender):
    """``update_weights_from_tensor(serialized_named_tensors, load_format="flattened_bucket", ...)``
    per bucket (see the module docstring): for an engine on the trainer's GPU (CUDA IPC), or, on
    CPU, for engine processes of the same parent (shared memory; test set-ups).
    ``engine_ranks``: the engine's TP size (one serialized copy per rank)."""

    def _send(self, bucket: BucketMeta, buf: torch.Tensor, slot: int) -> _Pending:
        futures, at = [], 0
        groups = _requests(bucket.tensors, self.group_by_dtype)
        # CPU tensors are shared by moving their storage into shared memory: stage them, so the
        # export buffers stay as they are.
        copy = buf.device.type == "cpu"
        for i, tensors in enumerate(groups):
            data = self.packer.pack(tensors, buf, slot, at=at, copy=copy)
            at += region(data.numel())
            unit = tensors[0].dtype.itemsize if self.group_by_dtype else 1
            flat = data.view(tensors[0].dtype) if self.group_by_dtype else data
            metadata, start = [], 0
            for t in tensors:
                n = t.nbytes // unit
                meta = dict(name=t.name, shape=torch.Size(t.shape), dtype=t.dtype)
                metadata.append(types.SimpleNamespace(**meta, start_idx=start, end_idx=start + n, numel=n))
                start += n
            if flat.is_cuda:  # the engine reads the bytes through CUDA IPC, outside this process's streams
                torch.cuda.current_stream(flat.device).synchronize()
            payload = {"flattened_tensor": flat, "metadata": metadata}
            futures.append(
                self.calls.submit(
                    "update_weights_from_tensor",
                    serialized_named_tensors=[serialize(payload) for _ in range(self.engine_ranks)],
                    load_format="flattened_bucket",
                    **self._last(bucket, i, groups, (), futures),
                )
            )
        return _Pending(self, bucket, (), futures)
