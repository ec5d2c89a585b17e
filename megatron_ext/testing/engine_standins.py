"""STAND-INS for the engine side of vLLM's and SGLang's weight-update protocols. TEST SUPPORT ONLY.

Neither engine can be installed on our machines, so the adapters of
:mod:`megatron_ext.weight_export.adapters` are tested against these classes,
which implement the engine side of each protocol the way the engines' sources
do (read from their repositories, written here independently): how the engine
joins the trainer's group (rendezvous, rank offsets), what each call accepts
and refuses, the order in which it receives, how it cuts and unpacks a packed /
flattened bucket, when it reports a weight version. Each class names the file
and function of the real engine it mirrors. What differs, on purpose:

- vLLM's data plane is ``PyNcclCommunicator`` (CUDA only); the stand-in keeps
  the rendezvous of vLLM's ``StatelessProcessGroup`` (rank 0 hosts a TCP store
  at ``master_address:master_port``, the others connect) and moves the bytes
  with gloo, so it runs on CPU.
- the engine's model is a dict of HF-named tensors (:class:`StandinModel`), whose
  ``load_weights`` refuses unknown names and wrong shapes as vLLM's and SGLang's
  model loaders do.
- the engines' HTTP / ``collective_rpc`` front end is a small JSON RPC
  (:class:`StandinServer` on each engine rank, :class:`StandinClient` on the
  trainer): the trainer's ``call(method, *args, **kwargs)`` reaches every engine
  rank at once, as ``collective_rpc`` and SGLang's tokenizer manager do, and its
  arguments must be JSON (as over HTTP).
"""

from __future__ import annotations

import base64
import datetime
import io
import math
import pickle
import threading

import torch
import torch.distributed as dist

from megatron_ext.weight_export import control
from megatron_ext.weight_export.adapters.base import PyNcclGroup, TorchGroup

__all__ = [
    "FlattenedTensorBucketStandin",
    "SglangEngineStandin",
    "StandinClient",
    "StandinModel",
    "StandinServer",
    "StatelessGroup",
    "VllmNcclWorkerStandin",
    "VllmWorkerExtensionStandin",
    "init_custom_process_group",
    "packed_chunk_sizes",
    "unpack_chunk",
    "vllm_trainer_group",
]

VLLM_DEFAULT_PACKED_BUFFER_BYTES = 1 << 30  # vllm/distributed/weight_transfer/packed_tensor.py
VLLM_DEFAULT_PACKED_NUM_BUFFERS = 2


class StandinModel:
    """An engine's model as a weight update sees it: HF-named parameters and ``load_weights``.

    Mirrors the checks of vLLM's model loaders (``params_dict[name]`` raises ``KeyError`` for an
    unknown name; ``vllm/model_executor/model_loader/weight_utils.py`` ``default_weight_loader``
    asserts ``Attempted to load weight (...) into parameter (...)``), which SGLang's share."""

    def __init__(self, params: dict[str, torch.Tensor], device=None):
        self.params = {n: torch.zeros_like(p.detach(), device=device) for n, p in params.items()}
        self.device = torch.device(device or "cpu")
        self.loaded = 0  # tensors loaded so far

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name not in self.params:
                raise KeyError(f"{name!r}: no such parameter in the engine's model")
            p = self.params[name]
            if p.size() != w.size():
                raise AssertionError(f"Attempted to load weight ({w.size()}) into parameter ({p.size()})")
            p.copy_(w)
            self.loaded += 1

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}


# ------------------------------------------------------------------------------------------ vLLM
class StatelessGroup:
    """Stand-in for vLLM's ``StatelessProcessGroup.create(host, port, rank, world_size)`` +
    ``PyNcclCommunicator(pg, device)`` (``vllm/distributed/utils.py``,
    ``vllm/distributed/device_communicators/pynccl.py``): the same rendezvous (rank 0 hosts a
    TCP store at ``host:port``) and ``broadcast(tensor, src, stream=None)`` (enqueued on the
    current stream), over torch's gloo (CPU) or NCCL (CUDA ``device``) instead of PyNccl."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, device=None):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        prefix = dist.PrefixStore("vllm_standin", self.store)
        if device is not None and torch.device(device).type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
        self.rank = rank

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        # CPU: done; CUDA: the current stream waits for it (PyNccl enqueues on the current stream)
        self.pg.broadcast(tensor, src).wait()


def vllm_trainer_group(master_address: str, master_port: int, world_size: int, device, timeout_s: float):
    """The adapters' ``group=`` against the vLLM stand-ins: the trainer's end (rank 0) of
    :class:`StatelessGroup`, wrapped as the adapter wraps vLLM's communicator (on CUDA:
    :class:`~megatron_ext.weight_export.adapters.base.PyNcclGroup`). The real default is
    ``vllm_nccl_group`` (vLLM's own classes)."""
    group = StatelessGroup(master_address, master_port, 0, world_size, timeout_s, device)
    out = PyNcclGroup(group) if device is not None and torch.device(device).type == "cuda" else TorchGroup(group.pg)
    out.standin = group  # keeps the store alive
    return out


def packed_chunk_sizes(sizes: list[int], limit: int) -> list[int]:
    """The byte sizes of the chunks vLLM's ``packed_broadcast_consumer``
    (``vllm/distributed/weight_transfer/packed_tensor.py``) receives for tensors of ``sizes``:
    a chunk takes tensors until its size exceeds ``limit``; the remainder is the last chunk."""
    out, total, count = [], 0, 0
    for n in sizes:
        total += n
        count += 1
        if total > limit:
            out.append(total)
            total, count = 0, 0
    if count:
        out.append(total)
    return out


def unpack_chunk(packed: torch.Tensor, metas) -> list[tuple[str, torch.Tensor]]:
    """vLLM's ``unpack_tensor`` (``packed_tensor.py``): ``split`` the uint8 chunk by the tensors'
    byte sizes, then ``.contiguous().view(dtype).view(*shape)`` each piece (``metas``: ``(name,
    shape, dtype)``). A piece at a byte offset that is not a multiple of its dtype's size cannot
    be viewed (torch refuses), as in vLLM."""
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in metas]
    parts = packed.split(sizes)
    return [(name, t.contiguous().view(dtype).view(*shape)) for (name, shape, dtype), t in zip(metas, parts)]


def _parse(kind: str, fields: dict, allowed: tuple, required: tuple) -> dict:
    """vLLM's ``parse_init_info`` / ``parse_update_info`` (``weight_transfer/base.py``): the dict
    goes to the backend's dataclass; an unknown or missing field is ``ValueError("Invalid ...")``."""
    for k in fields:
        if k not in allowed:
            raise ValueError(
                f"Invalid {kind} for NCCLWeightTransferEngine: __init__() got an unexpected keyword argument {k!r}"
            )
    for k in required:
        if k not in fields:
            raise ValueError(f"Invalid {kind} for NCCLWeightTransferEngine: missing required argument {k!r}")
    return dict(fields)


class VllmNcclWorkerStandin:
    """Stand-in for one vLLM worker with ``WeightTransferConfig(backend="nccl")`` and the LLM /
    HTTP calls that reach it (``llm.init_weight_transfer_engine`` ... ``finish_weight_update``).

    Mirrors ``vllm/distributed/weight_transfer/nccl_engine.py`` ``NCCLWeightTransferEngine``
    (``init_transfer_engine``: rank ``dp_rank * world_size_per_dp + rank + rank_offset`` in a
    ``StatelessProcessGroup`` of ``world_size``; ``receive_weights``: packed through
    ``packed_broadcast_consumer`` or one broadcast per tensor, each batch into
    ``model.load_weights``), ``weight_transfer/base.py`` (``parse_init_info`` /
    ``parse_update_info``) and the LLM's ``finish_weight_update(weight_version)`` (the version
    is recorded once the update finished). ``era``: where ``packed`` and the buffer sizes
    travel: ``"update_info"`` (releases: ``NCCLWeightTransferUpdateInfo`` fields) or
    ``"init_info"`` (vLLM main: ``NCCLWeightTransferInitInfo`` fields, set at the handshake)."""

    INIT = ("master_address", "master_port", "rank_offset", "world_size")
    UPDATE = ("names", "dtype_names", "shapes", "is_checkpoint_format")
    WIRE = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")

    def __init__(self, model: StandinModel, *, rank: int, world_size_per_dp: int, dp_rank: int = 0, era: str):
        if era not in ("update_info", "init_info"):
            raise ValueError(f"era must be 'update_info' or 'init_info', got {era!r}")
        self.model, self.rank, self.per_dp, self.dp_rank, self.era = model, rank, world_size_per_dp, dp_rank, era
        self.group: StatelessGroup | None = None
        self.wire = dict(packed=False, packed_buffer_size_bytes=VLLM_DEFAULT_PACKED_BUFFER_BYTES)
        self.updating = False
        self.weight_version: str | None = None
        self.chunks: list[int] = []  # byte size of every packed chunk received
        self.timeout_s = 60.0

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        allowed = self.INIT + (self.WIRE if self.era == "init_info" else ())
        info = _parse("init_info", init_info, allowed, self.INIT)
        if self.era == "init_info":
            self.wire.update({k: info[k] for k in self.WIRE if k in info})
        rank = self.dp_rank * self.per_dp + self.rank + info["rank_offset"]
        self.group = StatelessGroup(
            info["master_address"], info["master_port"], rank, info["world_size"], self.timeout_s, self.model.device
        )

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        if self.group is None:
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        self.updating = True

    def update_weights(self, update_info: dict) -> None:
        if not self.updating:
            raise RuntimeError("update_weights called before start_weight_update")
        allowed = self.UPDATE + (self.WIRE if self.era == "update_info" else ())
        info = _parse("update_info", update_info, allowed, self.UPDATE[:3])
        names, dtype_names, shapes = info["names"], info["dtype_names"], info["shapes"]
        if len(dtype_names) != len(names):
            raise ValueError(
                f"`dtype_names` should be of the same size as `names`: got {len(dtype_names)} and {len(names)}"
            )
        if len(shapes) != len(names):
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(shapes)} and {len(names)}")
        wire = dict(self.wire)
        if self.era == "update_info":
            wire = dict(packed=False, packed_buffer_size_bytes=VLLM_DEFAULT_PACKED_BUFFER_BYTES)
            wire.update({k: info[k] for k in self.WIRE if k in info})
        metas = [(n, list(s), getattr(torch, d)) for n, d, s in zip(names, dtype_names, shapes)]
        if wire["packed"]:
            self._packed_consumer(metas, wire["packed_buffer_size_bytes"])
        else:
            for name, shape, dtype in metas:
                weight = torch.empty(shape, dtype=dtype, device=self.model.device)
                self.group.broadcast(weight, src=0)
                self.model.load_weights([(name, weight)])

    def _packed_consumer(self, metas, limit: int) -> None:
        """``packed_broadcast_consumer``: gather metadata until the chunk exceeds ``limit`` (or the
        list ends), receive the chunk as uint8, split it back into the tensors, load them."""
        it = iter(metas)
        done = False
        while not done:
            chunk, total = [], 0
            while True:
                try:
                    name, shape, dtype = next(it)
                except StopIteration:
                    done = True
                    break
                size = math.prod(shape) * dtype.itemsize
                chunk.append((name, shape, dtype, size))
                total += size
                if total > limit:
                    break
            if not chunk:
                break
            packed = torch.empty(total, dtype=torch.uint8, device=self.model.device)
            self.group.broadcast(packed, src=0)
            self.chunks.append(total)
            self.model.load_weights(unpack_chunk(packed, [c[:3] for c in chunk]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.updating = False
        if weight_version is not None:
            self.weight_version = weight_version

    def get_weight_version(self) -> str | None:
        return self.weight_version


class VllmWorkerExtensionStandin:
    """Stand-in for the worker extension of vLLM's RLHF example
    (``examples/offline_inference/rlhf_utils.py`` ``WorkerExtension``), reached through
    ``llm.collective_rpc``: ``init_weight_update_group`` joins at ``world rank + rank_offset``;
    ``update_weight(name, dtype_name, shape)`` receives one broadcast and loads it."""

    def __init__(self, model: StandinModel, *, world_rank: int):
        self.model, self.world_rank = model, world_rank
        self.group: StatelessGroup | None = None

    def init_weight_update_group(self, master_address, master_port, rank_offset, world_size) -> None:
        rank = self.world_rank + rank_offset
        self.group = StatelessGroup(master_address, master_port, rank, world_size, 60.0, self.model.device)

    def update_weight(self, name, dtype_name, shape) -> None:
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.model.device)
        self.group.broadcast(weight, src=0)
        self.model.load_weights([(name, weight)])


# ---------------------------------------------------------------------------------------- SGLang
def init_custom_process_group(*, backend, init_method, world_size, rank, group_name, timeout=None):
    """Mirrors SGLang's ``init_custom_process_group`` (``python/sglang/srt/utils/common.py``):
    ``rendezvous(init_method, rank, world_size)`` (rank 0 hosts the TCP store), the store
    prefixed with ``group_name``, ``_new_process_group_helper`` with no global ranks, and an
    identity ``pg_group_ranks`` so ``broadcast(src=0, group=pg)`` means group rank 0."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = timeout or c10d.default_pg_timeout
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class FlattenedTensorBucketStandin:
    """Mirrors SGLang's ``FlattenedTensorBucket`` (``python/sglang/srt/weight_sync/tensor_bucket.py``).
    ``multi_dtypes=True`` (versions with ``supports_multi_dtypes``): every tensor flattened to its
    bytes, concatenated; ``start_idx`` / ``end_idx`` / ``numel`` in bytes; reconstructed by
    ``view(dtype).reshape(shape)``. ``False`` (older): flattened in its own dtype and
    concatenated (``torch.cat`` promotes mixed dtypes), indices in elements, reconstructed by
    ``reshape(shape)`` then ``.to(dtype)``."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None, *, multi_dtypes: bool = True):
        self.multi_dtypes = multi_dtypes
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            parts, self.metadata, idx = [], [], 0
            for name, t in named_tensors:
                flat = t.flatten().view(torch.uint8) if multi_dtypes else t.flatten()
                parts.append(flat)
                self.metadata.append(
                    dict(
                        name=name,
                        shape=t.shape,
                        dtype=t.dtype,
                        start_idx=idx,
                        end_idx=idx + flat.numel(),
                        numel=flat.numel(),
                    )
                )
                idx += flat.numel()
            self.flattened_tensor = torch.cat(parts, dim=0)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for m in self.metadata:
            t = self.flattened_tensor[m["start_idx"] : m["end_idx"]]
            if self.multi_dtypes:
                t = t.view(m["dtype"]).reshape(m["shape"])
            else:
                t = t.reshape(m["shape"])
                if t.dtype != m["dtype"]:
                    t = t.to(m["dtype"])
            out.append((m["name"], t))
        return out


class _SafeUnpickler(pickle.Unpickler):
    """Mirrors SGLang's ``SafeUnpickler`` (``python/sglang/srt/utils/common.py``): only classes of
    allow-listed modules (Python builtins and ``types``, torch, multiprocessing's fd sharing)."""

    ALLOWED = (
        "builtins.",
        "collections.",
        "copyreg.",
        "functools.",
        "types.",
        "torch.",
        "multiprocessing.reduction.",
        "multiprocessing.resource_sharer.",
    )
    DENY = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("os", "system")}

    def find_class(self, module, name):
        if (module, name) in self.DENY or not any((module + ".").startswith(p) for p in self.ALLOWED):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


def _deserialize(data: str):
    """SGLang's ``MultiprocessingSerializer.deserialize``: base64 string -> restricted unpickle."""
    return _SafeUnpickler(io.BytesIO(base64.b64decode(data, validate=True))).load()


class SglangEngineStandin:
    """Stand-in for one TP rank of an SGLang engine (scheduler + ``ModelRunner``), answering the
    weight-update endpoints as its HTTP server does (``{"success": ..., "message": ...}``).

    Mirrors ``python/sglang/srt/model_executor/model_runner.py``: ``init_weights_update_group``
    (rank ``rank_offset + tp_rank``, :func:`init_custom_process_group` with
    ``init_method="tcp://master_address:master_port"``), ``update_weights_from_distributed``
    (``load_format="flattened_bucket"``: ``_update_bucketed_weights_from_distributed``, one
    broadcast into a :class:`FlattenedTensorBucketStandin` of empty tensors; else one async
    broadcast per tensor, all waited, then ``load_weights``; a failure answers
    ``success=False``), ``update_weights_from_tensor`` (``serialized_named_tensors[tp_rank]``
    deserialized; flattened buckets through ``_update_weights_from_flattened_bucket``), and the
    tokenizer manager's weight version (set when an update with ``weight_version`` succeeded, or by
    ``update_weight_version``; ``get_weight_version``). The request fields are those of ``io_struct.py``'s
    ``InitWeightsUpdateGroupReqInput`` / ``UpdateWeightsFromDistributedReqInput`` /
    ``UpdateWeightsFromTensorReqInput``."""

    def __init__(self, model: StandinModel, *, tp_rank: int, multi_dtypes: bool = True):
        self.model, self.tp_rank, self.multi_dtypes = model, tp_rank, multi_dtypes
        self.groups: dict[str, object] = {}
        self.weight_version: str | None = None
        self.cache_flushes = 0
        self.requests = 0

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name="weight_update_group", backend="nccl"
    ) -> dict:
        assert dist.is_initialized(), "Default torch process group must be initialized"
        assert group_name != "", "Group name cannot be empty"
        rank = rank_offset + self.tp_rank
        try:
            self.groups[group_name] = init_custom_process_group(
                backend=backend,
                init_method=f"tcp://{master_address}:{master_port}",
                world_size=world_size,
                rank=rank,
                group_name=group_name,
                timeout=datetime.timedelta(seconds=60),
            )
            return {"success": True, "message": "Succeeded to initialize custom process group."}
        except Exception as e:  # noqa: BLE001 - answered like the engine
            return {"success": False, "message": f"Failed to initialize custom process group: {e}."}

    def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        group_name="weight_update_group",
        flush_cache=True,
        abort_all_requests=False,
        weight_version=None,
        load_format=None,
        torch_empty_cache=False,
    ) -> dict:
        self.requests += 1
        if group_name not in self.groups:
            return {"success": False, "message": f"Group {group_name} not in {list(self.groups)}."}
        group = self.groups[group_name]
        try:
            if load_format == "flattened_bucket":
                dev = self.model.device
                named = [
                    (n, torch.empty(s, dtype=getattr(torch, d), device=dev)) for n, d, s in zip(names, dtypes, shapes)
                ]
                bucket = FlattenedTensorBucketStandin(named_tensors=named, multi_dtypes=self.multi_dtypes)
                dist.broadcast(bucket.flattened_tensor, src=0, group=group)
                self.model.load_weights(bucket.reconstruct_tensors())
            else:
                weights, handles = [], []
                for n, d, s in zip(names, dtypes, shapes):
                    w = torch.empty(s, dtype=getattr(torch, d), device=self.model.device)
                    handles.append(dist.broadcast(w, src=0, group=group, async_op=True))
                    weights.append((n, w))
                for h in handles:
                    h.wait()
                self.model.load_weights(weights)
        except Exception as e:  # noqa: BLE001 - answered like the engine
            return {
                "success": False,
                "message": f"Failed to update parameter online: {e}. The full weights of the ModelRunner are "
                "partially updated. Please discard the whole weights.",
            }
        return self._succeeded(flush_cache, weight_version)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors,
        load_format=None,
        flush_cache=True,
        abort_all_requests=False,
        weight_version=None,
        disable_draft_model=None,
    ) -> dict:
        self.requests += 1
        try:
            named = _deserialize(serialized_named_tensors[self.tp_rank])
            if load_format == "flattened_bucket":
                metadata = [
                    dict(
                        name=m.name,
                        shape=m.shape,
                        dtype=m.dtype,
                        start_idx=m.start_idx,
                        end_idx=m.end_idx,
                        numel=m.numel,
                    )
                    for m in named["metadata"]
                ]
                bucket = FlattenedTensorBucketStandin(
                    flattened_tensor=named["flattened_tensor"], metadata=metadata, multi_dtypes=self.multi_dtypes
                )
                self.model.load_weights(bucket.reconstruct_tensors())
            elif load_format is None:
                self.model.load_weights(named)
            else:
                raise NotImplementedError(f"Unknown load_format={load_format}")
        except Exception as e:  # noqa: BLE001 - answered like the engine
            return {"success": False, "message": f"{type(e).__name__}: {e}"}
        return self._succeeded(flush_cache, weight_version)

    def _succeeded(self, flush_cache, weight_version) -> dict:
        if flush_cache:
            self.cache_flushes += 1
        if weight_version is not None:
            self.weight_version = weight_version
        return {"success": True, "message": "Succeeded to update parameter online."}

    def update_weight_version(self, new_version, abort_all_requests=True) -> dict:
        """The tokenizer manager's ``update_weight_version`` (``UpdateWeightVersionReqInput``)."""
        self.weight_version = new_version
        return {"success": True, "message": f"Weight version updated to {new_version}."}

    def get_weight_version(self) -> dict:
        return {"weight_version": self.weight_version}


# -------------------------------------------------------------------------------- the front end
class StandinServer:
    """One engine rank's front end: answers the trainer's calls for the stand-ins in ``engines``
    (name -> stand-in), one at a time, until the trainer says ``close``."""

    def __init__(self, engines: dict[str, object], address: str, *, key: bytes):
        self.engines, self.address, self.key = engines, address, key
        self.listener = control.Listener(address, key=key, what="trainer (stand-in RPC)")

    def serve(self, timeout_s: float = 300.0) -> None:
        with self.listener:
            ch = self.listener.accept(timeout_s)
        try:
            while True:
                msg = ch.recv(timeout_s)
                if msg.kind == "close":
                    return
                engine, method = self.engines[msg["engine"]], msg["method"]
                try:
                    value = getattr(engine, method)(*msg["args"], **msg["kwargs"])
                    ch.send("result", value=value)
                except Exception as exc:  # noqa: BLE001 - the caller gets it, as over HTTP or Ray
                    ch.send("error", reason=f"{type(exc).__name__}: {exc}")
        finally:
            ch.close()


class StandinClient:
    """The trainer's end: ``caller(engine)`` is a ``call(method, *args, **kwargs)`` that reaches
    that stand-in on every engine rank at once and returns when all answered. ``merge``:
    ``"raise"`` (vLLM: any rank's error is raised, else the first rank's value) or ``"sglang"``
    (the tokenizer manager's merge: success if every rank succeeded, the failures' messages)."""

    def __init__(self, addresses: list[str], *, key: bytes, timeout_s: float = 120.0):
        self.addresses, self.timeout_s = addresses, timeout_s
        self.chans = [control.connect(a, timeout_s=timeout_s, key=key, what="stand-in engine") for a in addresses]
        self.lock = threading.Lock()
        self.log: list[tuple[str, str]] = []  # (engine, method) of every call, in order

    def caller(self, engine: str, merge: str = "raise"):
        def call(method: str, *args, **kwargs):
            with self.lock:
                self.log.append((engine, method))
                for ch in self.chans:
                    ch.send("call", engine=engine, method=method, args=list(args), kwargs=kwargs)
                answers = [ch.recv(self.timeout_s) for ch in self.chans]
            if merge == "sglang":
                failed = [
                    a["reason"] if a.kind == "error" else a["value"]["message"]
                    for a in answers
                    if a.kind == "error" or (isinstance(a["value"], dict) and a["value"].get("success") is False)
                ]
                if failed:
                    return {"success": False, "message": "; ".join(failed)}
                return answers[0]["value"]
            for i, a in enumerate(answers):
                if a.kind == "error":
                    raise RuntimeError(f"engine rank {i} failed {method}: {a['reason']}")
            return answers[0]["value"]

        return call

    def close(self) -> None:
        for ch in self.chans:
            try:
                ch.send("close")
            except control.ControlError:
                pass
            ch.close()
