"""STAND-INS for the engine side of vLLM's and SGLang's weight-update protocols. TEST SUPPORT ONLY.

Neither engine can be installed on our machines, so the adapters of
:mod:`megatron_ext.weight_export.engines.adapters` are tested against these classes,
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
- vLLM's ``ipc`` backend maps CUDA IPC handles (CUDA only); on CPU its stand-in
  takes :class:`CudaIpcStandin` instead of torch's ``rebuild_cuda_tensor`` and the
  GPU's UUID: handles of the same tuple layout naming tensors of one process.
- the engine's model is a dict of HF-named tensors (:class:`StandinModel`), whose
  ``load_weights`` refuses unknown names and wrong shapes as vLLM's and SGLang's
  model loaders do.
- the engines' HTTP / ``collective_rpc`` front end is a small JSON RPC
  (:class:`StandinServer` on each engine rank, :class:`StandinClient` on the
  trainer): the trainer's ``call(method, *args, **kwargs)`` reaches every engine
  rank at once, as ``collective_rpc`` and SGLang's tokenizer manager do, and its
  arguments must be JSON (as over HTTP).
- a test job's one world holds the trainer and the engine ranks, which real
  engines' worlds never do: the SGLang stand-in's group is created as the
  trainer's is (not split from the default group's NCCL communicator, see
  :func:`~megatron_ext.weight_export.engines.adapters.sglang.unbound_default_group`),
  and the vLLM stand-in's groups (torch process groups, which tear their
  communicator down when dropped, unlike PyNccl's) are kept until every rank
  calls :func:`release_groups` at the end of the job: NCCL cannot tear down one
  end of a group while another end is up. :func:`nccl_teardown_rule` gives gloo
  jobs that rule for the trainer-engine groups, so CPU tests show a one-sided
  teardown too.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import math
import pickle
import threading
import time

import torch
import torch.distributed as dist

from megatron_ext.weight_export.control import channel as control
from megatron_ext.weight_export.engines.adapters.base import PyNcclGroup, TorchGroup
from megatron_ext.weight_export.engines.adapters.sglang import unbound_default_group

__all__ = [
    "CudaIpcStandin",
    "FlattenedTensorBucketStandin",
    "SglangEngineStandin",
    "StandinClient",
    "StandinModel",
    "StandinServer",
    "StatelessGroup",
    "VllmIpcWorkerStandin",
    "VllmNcclWorkerStandin",
    "VllmWorkerExtensionStandin",
    "init_custom_process_group",
    "nccl_teardown_rule",
    "packed_chunk_sizes",
    "release_groups",
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
        self.rank, self.port = rank, port
        _LIVE.append(self)  # never torn down by being dropped: see release_groups

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        # CPU: done; CUDA: the current stream waits for it (PyNccl enqueues on the current stream)
        self.pg.broadcast(tensor, src).wait()


# This process's ends of every StatelessGroup (the trainer's and the engines'), kept until release_groups().
_LIVE: list[StatelessGroup] = []


def release_groups() -> int:
    """Shut down this process's ends of every :class:`StatelessGroup`; returns how many. Every rank of
    a test job calls it once the trainer closed its adapters and the engines stopped serving.

    vLLM's PyNccl communicator is never destroyed; a torch ``ProcessGroupNCCL`` aborts its
    communicator when dropped, and NCCL's teardown of one end (every graceful destroy, and an abort
    where cuMem host memory is unavailable) waits in its proxy thread until the peer ranks close
    their connections to it, i.e. tear down their ends too. So the stand-in groups stay up until
    every rank calls this, and every rank shuts its ends down in the same order (by port), so that
    no two ranks wait on each other's different groups."""
    groups = sorted(_LIVE, key=lambda g: g.port)
    _LIVE.clear()
    for group in groups:
        shutdown = getattr(group.pg, "shutdown", None) or getattr(group.pg, "_shutdown", None)
        if shutdown is not None:
            shutdown()
    return len(groups)


@contextlib.contextmanager
def nccl_teardown_rule(limit_s: float = 30.0, prefix: str = "weight_update"):
    """Within: ``dist.destroy_process_group(group)`` of a group named ``prefix...`` (the trainer-engine
    groups) returns only once every rank of the group has begun destroying its end, as on NCCL
    (whose proxy thread serves the peers' connections until they tear down their ends); gloo's
    teardown is local, so without this a CPU job cannot show an end torn down alone. Such an end
    raises RuntimeError after ``limit_s`` (on NCCL it waits forever)."""
    from torch.distributed import distributed_c10d as c10d

    real = dist.destroy_process_group

    def destroy_process_group(group=None):
        name = getattr(group, "group_name", "") if group is not None else ""
        if name.startswith(prefix) and group in c10d._world.pg_map:
            store = c10d._world.pg_map[group][1]
            store.add("nccl_teardown_rule/down", 1)
            deadline = time.monotonic() + limit_s
            while store.add("nccl_teardown_rule/down", 0) < group.size():
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"this end of group {name} was torn down alone for {limit_s:g}s (on NCCL that blocks until "
                        "every other end is torn down too)"
                    )
                time.sleep(0.01)
        real(group)

    dist.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = real


def vllm_trainer_group(master_address: str, master_port: int, world_size: int, device, timeout_s: float):
    """The adapters' ``group=`` against the vLLM stand-ins: the trainer's end (rank 0) of
    :class:`StatelessGroup`, wrapped as the adapter wraps vLLM's communicator (on CUDA:
    :class:`~megatron_ext.weight_export.engines.adapters.base.PyNcclGroup`). The real default is
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


def unpack_chunk(packed: torch.Tensor, metas, sizes=None) -> list[tuple[str, torch.Tensor]]:
    """vLLM's ``unpack_tensor`` (``packed_tensor.py``): ``split`` the uint8 chunk by the tensors'
    byte sizes (``sizes``, by default computed from ``metas``: ``(name, shape, dtype)``), then
    ``.contiguous().view(dtype).view(*shape)`` each piece. A piece at a byte offset that is not a
    multiple of its dtype's size cannot be viewed (torch refuses), as in vLLM."""
    if sizes is None:
        sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in metas]
    parts = packed.split(list(sizes))
    return [(name, t.contiguous().view(dtype).view(*shape)) for (name, shape, dtype), t in zip(metas, parts)]


def _parse(kind: str, fields: dict, allowed: tuple, required: tuple, engine="NCCLWeightTransferEngine") -> dict:
    """vLLM's ``parse_init_info`` / ``parse_update_info`` (``weight_transfer/base.py``): the dict
    goes to the backend's dataclass; an unknown or missing field is ``ValueError("Invalid ...")``."""
    for k in fields:
        if k not in allowed:
            raise ValueError(f"Invalid {kind} for {engine}: __init__() got an unexpected keyword argument {k!r}")
    for k in required:
        if k not in fields:
            raise ValueError(f"Invalid {kind} for {engine}: missing required argument {k!r}")
    return dict(fields)


def _check_lengths(names, **lists) -> None:
    """The length checks of the update-info dataclasses' ``__post_init__`` (``nccl_engine.py``, ``ipc_engine.py``)."""
    for field, values in lists.items():
        if len(values) != len(names):
            raise ValueError(f"`{field}` should be of the same size as `names`: got {len(values)} and {len(names)}")


class _VllmWorkerSession:
    """The update session of a vLLM worker (``vllm/v1/worker/gpu_worker.py``: ``start_weight_update``
    refuses a second start, ``update_weights`` and ``finish_weight_update`` need a started one) and
    the LLM's ``finish_weight_update(weight_version)``, which records the version once the update
    finished; ``get_weight_version`` reports it."""

    def __init__(self):
        self.updating = False
        self.sessions = 0  # start_weight_update calls accepted
        self.weight_version: str | None = None

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        if self.updating:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self.updating = True
        self.sessions += 1

    def _require_session(self, method: str) -> None:
        if not self.updating:
            raise RuntimeError(f"start_weight_update must be called before {method}.")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._require_session("finish_weight_update")
        self.updating = False
        if weight_version is not None:
            self.weight_version = weight_version

    def get_weight_version(self) -> str | None:
        return self.weight_version


class VllmNcclWorkerStandin(_VllmWorkerSession):
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
        super().__init__()
        if era not in ("update_info", "init_info"):
            raise ValueError(f"era must be 'update_info' or 'init_info', got {era!r}")
        self.model, self.rank, self.per_dp, self.dp_rank, self.era = model, rank, world_size_per_dp, dp_rank, era
        self.group: StatelessGroup | None = None
        self.wire = dict(packed=False, packed_buffer_size_bytes=VLLM_DEFAULT_PACKED_BUFFER_BYTES)
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
        super().start_weight_update(is_checkpoint_format)

    def update_weights(self, update_info: dict) -> None:
        self._require_session("update_weights")
        allowed = self.UPDATE + (self.WIRE if self.era == "update_info" else ())
        info = _parse("update_info", update_info, allowed, self.UPDATE[:3])
        names, dtype_names, shapes = info["names"], info["dtype_names"], info["shapes"]
        _check_lengths(names, dtype_names=dtype_names, shapes=shapes)
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


class CudaIpcStandin:
    """CUDA IPC within one process, for CPU tests of the ``ipc`` route: :meth:`shares` makes handles
    with the layout of torch's ``reduce_tensor`` argument tuple for a CUDA tensor (tensor class,
    size, stride, offset, storage class, dtype, device index at 6, storage handle at 7, ...), the
    handle naming a storage registered here; :meth:`rebuild` is ``rebuild_cuda_tensor``'s
    counterpart (a view of that storage, not a copy), :attr:`uuid` the GPU UUID both sides use."""

    uuid = "GPU-00000000-0000-0000-0000-standin00000"

    def __init__(self):
        self.storages: dict[bytes, torch.UntypedStorage] = {}
        self.shared = 0  # handles made

    def shares(self):
        """A sharer for one request, like the adapter's ``CudaIpcShares`` (``keep``: what it holds)."""

        def share(t: torch.Tensor) -> tuple:
            storage = t.untyped_storage()
            handle = f"standin-{storage.data_ptr()}".encode()
            self.storages[handle] = storage
            share.keep[storage.data_ptr()] = t
            self.shared += 1
            nbytes = storage.nbytes()
            return (torch.Tensor, t.size(), t.stride(), t.storage_offset(), torch.storage.TypedStorage, t.dtype, 0,
                    handle, nbytes, 0, False, b"", 0, b"", False)  # fmt: skip

        share.keep = {}
        return share

    def rebuild(self, tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, *rest) -> torch.Tensor:
        if device != 0:
            raise AssertionError(f"the worker rebuilds on its own device (index 0 here), got {device}")
        return torch.empty(0, dtype=dtype).set_(self.storages[handle], offset, size, stride)


class VllmIpcWorkerStandin(_VllmWorkerSession):
    """Stand-in for one vLLM worker with ``WeightTransferConfig(backend="ipc")`` and the LLM / HTTP
    calls that reach it.

    Mirrors ``vllm/distributed/weight_transfer/ipc_engine.py``: ``IPCWeightTransferInitInfo``
    (``packed`` in vLLM main, set at the handshake), ``IPCWeightTransferEngine.parse_update_info``
    (``ipc_handles_pickled``: base64 pickle, refused without ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``,
    refused beside ``ipc_handles``), ``IPCWeightTransferUpdateInfo`` (``names``, ``dtype_names``,
    ``shapes``, ``ipc_handles``, ``tensor_sizes``; its length checks), ``receive_weights`` (each
    handle a ``{gpu_uuid: args}`` dict, the worker's own UUID taken, device index put at position 6,
    the tensor rebuilt with ``rebuild_cuda_tensor``; packed: one handle for the request, cut by
    ``packed_ipc_consumer`` / ``unpack_tensor`` of ``packed_tensor.py``), then ``load_weights`` and a
    device synchronize (``WeightTransferEngine.update_weights``, ``base.py``).

    ``era``: where ``packed`` comes from: ``"init_info"`` (vLLM main), ``"engine_config"``
    (``IPCWeightTransferConfig.packed``, given as ``packed``) or ``"update_info"`` (versions whose
    update info has ``packed``). ``allow_insecure_serialization``: the engine's
    ``VLLM_ALLOW_INSECURE_SERIALIZATION``. ``ipc``: a :class:`CudaIpcStandin` on CPU; None on CUDA
    (torch's ``rebuild_cuda_tensor`` and the GPU's UUID). ``delay_s``: each ``update_weights`` waits
    that long before it maps the handles (a busy engine; a trainer that writes a buffer again before
    the engine answered would be caught). ``refuse_session``: a FAULT INJECTION, not vLLM
    behaviour: the ``update_weights`` calls of that session (1 = the first version) raise before
    loading anything."""

    UPDATE = ("names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes")

    def __init__(
        self,
        model: StandinModel,
        *,
        era: str = "init_info",
        packed: bool = False,
        allow_insecure_serialization: bool = True,
        ipc: CudaIpcStandin | None = None,
        refuse_session: int | None = None,
        delay_s: float = 0.0,
    ):
        super().__init__()
        if era not in ("init_info", "engine_config", "update_info"):
            raise ValueError(f"era must be 'init_info', 'engine_config' or 'update_info', got {era!r}")
        self.model, self.era, self.packed = model, era, packed
        self.allow_insecure_serialization = allow_insecure_serialization
        self.ipc, self.refuse_session, self.delay_s = ipc, refuse_session, delay_s
        self.received: list[dict] = []  # what each update_weights carried (handles replaced by their count)

    def _device(self) -> tuple[int, str]:
        if self.ipc is not None:
            return 0, self.ipc.uuid
        index = self.model.device.index if self.model.device.index is not None else torch.cuda.current_device()
        return index, str(torch.cuda.get_device_properties(index).uuid)

    def _rebuild(self, args, device_index: int) -> torch.Tensor:
        args = list(args)
        args[6] = device_index  # the receiving worker's device
        if self.ipc is not None:
            return self.ipc.rebuild(*args)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*args)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        allowed = ("packed",) if self.era == "init_info" else ()
        info = _parse("init_info", init_info, allowed, (), engine="IPCWeightTransferEngine")
        if self.era == "init_info":
            self.packed = bool(info.get("packed", False))

    def update_weights(self, update_info: dict) -> None:
        self._require_session("update_weights")
        fields = dict(update_info)
        pickled = fields.pop("ipc_handles_pickled", None)
        if pickled is not None:
            if fields.get("ipc_handles") is not None:
                raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
            if not self.allow_insecure_serialization:
                raise ValueError(
                    "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
                )
            fields["ipc_handles"] = pickle.loads(base64.b64decode(pickled))
        allowed = self.UPDATE + (("packed",) if self.era == "update_info" else ())
        info = _parse("update_info", fields, allowed, self.UPDATE[:3], engine="IPCWeightTransferEngine")
        names, handles = info["names"], info.get("ipc_handles")
        if handles is None:
            raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")
        _check_lengths(names, dtype_names=info["dtype_names"], shapes=info["shapes"])
        if isinstance(handles, list):
            _check_lengths(names, ipc_handles=handles)
        packed = bool(info.get("packed", False)) if self.era == "update_info" else self.packed
        self.received.append(dict(info, ipc_handles=len(handles), pickled=pickled is not None, packed=packed))
        if self.refuse_session == self.sessions:
            raise RuntimeError(f"weight update session {self.sessions} refused (stand-in fault injection)")
        time.sleep(self.delay_s)
        device_index, uuid = self._device()

        def own(handle: dict):
            if uuid not in handle:
                raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(handle.keys())}")
            return self._rebuild(handle[uuid], device_index)

        if packed:
            if info.get("tensor_sizes") is None:
                raise ValueError("`tensor_sizes` is required when packed=True")
            assert isinstance(handles, dict)
            sizes = info["tensor_sizes"]
            metas = [(n, list(s), getattr(torch, d)) for n, d, s in zip(names, info["dtype_names"], info["shapes"])]
            weights = unpack_chunk(own(handles)[: sum(sizes)], metas, sizes)
        else:
            assert isinstance(handles, list)
            weights = [(name, own(handle)) for name, handle in zip(names, handles)]
        self.model.load_weights(weights)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)


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
    # Not split from the test world's default group, which holds the trainer too (an engine's does not).
    with unbound_default_group():
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
    ``update_weight_version``; ``get_weight_version``), and ``destroy_weights_update_group`` (the
    group popped and ``destroy_process_group``; an unknown name answers ``success=False``). The
    request fields are those of ``io_struct.py``'s ``InitWeightsUpdateGroupReqInput`` /
    ``UpdateWeightsFromDistributedReqInput`` / ``UpdateWeightsFromTensorReqInput`` /
    ``DestroyWeightsUpdateGroupReqInput``."""

    def __init__(self, model: StandinModel, *, tp_rank: int, multi_dtypes: bool = True):
        self.model, self.tp_rank, self.multi_dtypes = model, tp_rank, multi_dtypes
        self.groups: dict[str, object] = {}
        self.destroyed: list[str] = []  # groups destroyed by destroy_weights_update_group
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

    def destroy_weights_update_group(self, group_name) -> dict:
        try:
            if group_name not in self.groups:
                return {"success": False, "message": "The group to be destroyed does not exist."}
            dist.destroy_process_group(self.groups.pop(group_name))
            self.destroyed.append(group_name)
            return {"success": True, "message": "Succeeded to destroy custom process group."}
        except Exception as e:  # noqa: BLE001 - answered like the engine
            return {"success": False, "message": f"Failed to destroy custom process group: {e}."}

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
