"""vLLM's weight-update protocols, driven from the export hook (trainer side).

Three protocols, each a sender of :class:`~...exporter.WeightExporter`
(``WeightExporter(model, config, sender=adapter)``):

:class:`VllmWeightTransferSender` — vLLM's weight-transfer engine, ``nccl``
backend (``vllm/distributed/weight_transfer/nccl_engine.py``). The engine runs
with ``--weight-transfer-config '{"backend": "nccl"}'``; the trainer calls, in
this order::

    init_weight_transfer_engine(init_info={master_address, master_port, rank_offset=1, world_size})
    per version:  start_weight_update()
                  update_weights(update_info={names, dtype_names, shapes, ...})   # one per bucket
                  finish_weight_update(weight_version="<version>")

while it is rank 0 of the ``StatelessProcessGroup`` + ``PyNcclCommunicator``
group the workers build from ``init_info`` (worker rank = ``dp_rank * TP*PP +
rank + rank_offset``). Each ``update_weights`` call blocks in the worker's
receive, so it runs on the call thread while the trainer broadcasts the bucket.
Packed (default): the bucket's tensors back to back, cut into chunks the way
vLLM's ``packed_broadcast_consumer`` cuts them (a chunk ends with the tensor that
takes it past ``packed_buffer_size_bytes``), one uint8 broadcast per chunk.
Unpacked: one broadcast per tensor, in its dtype. Where ``packed`` and the buffer
size travel changed between vLLM versions: ``packed_params_in="update_info"``
(releases whose ``NCCLWeightTransferUpdateInfo`` has ``packed``),
``"init_info"`` (vLLM main: ``NCCLWeightTransferInitInfo`` carries them) or
``"engine_config"`` (the engine's ``--weight-transfer-config`` holds them: set
the same values here; nothing is sent).

:class:`VllmIpcSender` — the same engine with the ``ipc`` backend
(``vllm/distributed/weight_transfer/ipc_engine.py``, ``IPCWeightTransferEngine``),
for an engine on the trainer's GPU: no group; each ``update_weights`` carries
CUDA IPC handles of the export buffers, and is the transfer (the worker maps
them, loads the weights and synchronizes before it answers)::

    init_weight_transfer_engine(init_info={packed})                       # once
    per version:  start_weight_update()
                  update_weights(update_info={names, dtype_names, shapes,
                                              ipc_handles | ipc_handles_pickled[, tensor_sizes]})
                  finish_weight_update(weight_version="<version>")

A handle is the argument tuple of torch's ``rebuild_cuda_tensor`` (what
``reduce_tensor`` returns beside the function), keyed by the GPU's UUID
(``str(torch.cuda.get_device_properties(i).uuid)``): ``{uuid: args}``; the
worker takes the one of its own GPU and puts its device index at position 6.
Unpacked (default, vLLM's default too): one handle per tensor, a view of the
export buffer, so nothing is copied; one ``update_weights`` per bucket.
Packed: one handle per request for the request's tensors back to back
(``tensor_sizes``: their byte counts), which the worker cuts and views in
order; a request per bucket unless a dtype would start at an offset it cannot
view (:func:`~.base.aligned_requests`). Where ``packed`` travels changed between
vLLM versions, as for nccl: ``packed_params_in="init_info"`` (vLLM main:
``IPCWeightTransferInitInfo.packed``), ``"engine_config"``
(``IPCWeightTransferConfig.packed`` in ``--weight-transfer-config``: set the
same value here) or ``"update_info"`` (versions whose
``IPCWeightTransferUpdateInfo`` has ``packed``). ``pickle_handles=True`` sends
``ipc_handles_pickled`` (``base64(pickle.dumps(handles))``, what vLLM's HTTP
client sends) instead of ``ipc_handles``: needed when ``call`` posts JSON
itself; the worker unpickles it only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.

:class:`VllmWorkerExtensionSender` — the older ``collective_rpc`` route of
vLLM's RLHF examples (``examples/offline_inference/rlhf_utils.py``,
``WorkerExtension``): ``init_weight_update_group(master_address, master_port,
rank_offset, world_size)`` once, then ``update_weight(name, dtype_name, shape)``
per tensor, each receiving one broadcast. The engine runs with
``worker_extension_cls`` naming such a class; ``call`` wraps
``llm.collective_rpc``.

Wiring ``call(method, *args, **kwargs)``: over HTTP (``vllm serve`` with
``VLLM_SERVER_DEV_MODE=1``) ``requests.post(f"{url}/{method}", json=kwargs or
None, timeout=...).raise_for_status()``; in process or on Ray, vLLM's own
``HTTPVLLMWeightSyncClient`` / ``RayVLLMWeightSyncClient`` object (passed as
``call``), or ``lambda m, *a, **kw: llm.collective_rpc(m, args=a, kwargs=kw)``
for the worker extension.

The group: by default the trainer joins with vLLM's own classes
(:func:`vllm_nccl_group`: ``StatelessProcessGroup.create`` +
``PyNcclCommunicator``, so vLLM must be importable in the trainer, at the
engine's version); ``group=`` takes any ``group(master_address, master_port,
world_size, device, timeout_s)`` returning an object with ``broadcast(tensor)``
(:class:`~.base.TorchGroup`, :class:`~.base.PyNcclGroup`).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import pickle

import torch

from ...plan.export_plan import BucketMeta
from .base import (
    EngineCall,
    EngineSender,
    PyNcclGroup,
    _Pending,
    aligned_requests,
    check_choice,
    check_int,
    dtype_str,
    expect_version,
    region,
    threshold_chunks,
)

__all__ = [
    "PACKED_PARAMS_IN",
    "VLLM_DEFAULT_PACKED_BUFFER_BYTES",
    "CudaIpcShares",
    "VllmIpcSender",
    "VllmWeightTransferSender",
    "VllmWorkerExtensionSender",
    "gpu_uuid",
    "vllm_nccl_group",
]

VLLM_DEFAULT_PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES (packed_tensor.py)
PACKED_PARAMS_IN = ("update_info", "init_info", "engine_config")


def vllm_nccl_group(master_address: str, master_port: int, world_size: int, device, timeout_s: float):
    """The trainer's end (rank 0) of the group vLLM's workers build: vLLM's ``StatelessProcessGroup``
    (a TCP store the trainer hosts at ``master_address:master_port``) and ``PyNcclCommunicator``."""
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as exc:
        raise ImportError(
            f"joining vLLM's weight update group needs vllm importable in the trainer ({exc}); install the engine's "
            "vllm version here, or pass group=... (a function returning an object with broadcast(tensor))"
        ) from exc
    if device is None or torch.device(device).type != "cuda":
        raise ValueError(f"vLLM's NCCL weight transfer needs the export buffers on a CUDA device, got {device}")
    pg = StatelessProcessGroup.create(
        host=master_address, port=master_port, rank=0, world_size=world_size, store_timeout=int(timeout_s)
    )
    return PyNcclGroup(PyNcclCommunicator(pg, device=torch.device(device)))


class _VllmGroupSender(EngineSender):
    """What both vLLM routes share: the group the workers join (keyword arguments ``master_address``,
    ``master_port``, ``engine_ranks``, ``group``, ``timeout_s``; see the module docstring)."""

    def __init__(self, call, *, master_address, master_port=0, engine_ranks=1, group=None, timeout_s=120.0):
        super().__init__(call, timeout_s=timeout_s)
        self._set_master(master_address, master_port)
        self.engine_ranks = check_int("engine_ranks (the engine's TP x PP x DP workers)", engine_ranks, 1)
        self.world_size = 1 + self.engine_ranks
        self._group_factory = group or vllm_nccl_group

    def _rendezvous(self, fut) -> None:
        """Join the group as rank 0 while the engine's init call ``fut`` joins it on the workers."""
        self.group = self._join(
            fut,
            lambda: self._group_factory(
                self.master_address, self.master_port, self.world_size, self.device, self.timeout_s
            ),
        )


class _WeightTransferSession(EngineSender):
    """What vLLM's weight-transfer engine asks of a trainer whatever its backend
    (``vllm/distributed/weight_transfer/base.py``, the worker's ``start_weight_update`` /
    ``update_weights`` / ``finish_weight_update``): ``init_weight_transfer_engine`` once, a
    ``start_weight_update`` ... ``finish_weight_update(weight_version)`` session per version,
    ``update_weights`` requests that list ``names`` / ``dtype_names`` / ``shapes``, and the backend's
    ``packed`` flag where the engine's vLLM version reads it (``packed_params_in``). ``abort``
    closes the session without a version; ``check_version`` asks ``get_weight_version`` at the end."""

    what = "the vLLM engine"

    def __init__(self, call: EngineCall, *, packed: bool, packed_params_in: str, check_version: bool, **kwargs):
        super().__init__(call, **kwargs)
        if not isinstance(packed, bool):
            raise ValueError(f"packed must be True or False, got {packed!r}")
        self.packed = packed
        self.packed_params_in = check_choice("packed_params_in", packed_params_in, PACKED_PARAMS_IN)
        self.check_version = bool(check_version)
        self._open = False  # a version was started and not finished

    def _wire_params(self) -> dict:
        """The fields both ends must agree on (sent where ``packed_params_in`` says)."""
        return {"packed": self.packed}

    def _init_info(self, **fields) -> dict:
        if self.packed_params_in == "init_info":
            fields.update(self._wire_params())
        return fields

    def _update_info(self, tensors, **fields) -> dict:
        update_info = dict(
            names=[t.name for t in tensors],
            dtype_names=[dtype_str(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            **fields,
        )
        if self.packed_params_in == "update_info":
            update_info.update(self._wire_params())
        return update_info

    def _begin(self, version: int) -> None:
        self.calls.run("start_weight_update")
        self._open = True

    def abort(self, version: int) -> list[None]:
        """Close the engine's update session without a version (best effort, a few seconds at most):
        the workers finish processing what they loaded and accept the next ``start_weight_update``;
        the version is not published and the weights are partly written."""
        if self._open:
            self._open = False
            with contextlib.suppress(Exception):  # the engine may be gone or stuck; the version is dropped anyway
                self.calls.wait(self.calls.submit("finish_weight_update"), timeout_s=min(self.timeout_s, 5.0))
        return super().abort(version)

    def _finish(self, version: int) -> int:
        self._open = False
        self.calls.run("finish_weight_update", weight_version=str(version))
        if self.check_version:
            expect_version(self, self.calls.run("get_weight_version"), version)
        return version


class VllmWeightTransferSender(_WeightTransferSession, _VllmGroupSender):
    """vLLM's weight-transfer engine (``nccl`` backend), one ``update_weights`` per bucket.

    ``call``: the engine's four calls (see the module docstring). ``master_address``: the
    trainer's address the workers can reach (the trainer hosts the rendezvous store there);
    ``master_port`` 0 picks a free port. ``engine_ranks``: the engine's workers (TP x PP x DP).
    ``packed`` / ``packed_params_in`` / ``packed_buffer_size_bytes`` / ``packed_num_buffers``: see
    the module docstring (sizes None: vLLM's defaults, not sent). ``check_version``: after
    ``finish_weight_update`` ask ``get_weight_version`` and require the version just sent.
    ``group``: see the module docstring; ``timeout_s``: the bound of every wait (default 120)."""

    def __init__(
        self,
        call: EngineCall,
        *,
        packed: bool = True,
        packed_params_in: str = "update_info",
        packed_buffer_size_bytes: int | None = None,
        packed_num_buffers: int | None = None,
        check_version: bool = False,
        **group_kwargs,
    ):
        super().__init__(
            call, packed=packed, packed_params_in=packed_params_in, check_version=check_version, **group_kwargs
        )
        self.packed_buffer_size_bytes, self.packed_num_buffers = packed_buffer_size_bytes, packed_num_buffers
        for name, value in self._sizes().items():
            if value is not None:
                check_int(name, value, 1)

    @property
    def chunk_limit(self) -> int:
        """The byte count past which the workers close a packed chunk."""
        return self.packed_buffer_size_bytes or VLLM_DEFAULT_PACKED_BUFFER_BYTES

    def _sizes(self) -> dict:
        return dict(packed_buffer_size_bytes=self.packed_buffer_size_bytes, packed_num_buffers=self.packed_num_buffers)

    def _wire_params(self) -> dict:
        return {**super()._wire_params(), **{k: v for k, v in self._sizes().items() if v is not None}}

    def _connect(self) -> None:
        init_info = self._init_info(
            master_address=self.master_address,
            master_port=self._port(),
            rank_offset=1,
            world_size=self.world_size,
        )
        self._rendezvous(self.calls.submit("init_weight_transfer_engine", init_info=init_info))

    def _send(self, bucket: BucketMeta, buf: torch.Tensor, slot: int) -> _Pending:
        if not self.packed:
            fut = self.calls.submit("update_weights", update_info=self._update_info(bucket.tensors))
            works = [self.group.broadcast(t.view(buf)) for t in bucket.tensors]
            return _Pending(self, bucket, works, [fut])
        works, futures, at = [], [], 0
        for tensors in aligned_requests(bucket.tensors, self.chunk_limit):
            futures.append(self.calls.submit("update_weights", update_info=self._update_info(tensors)))
            data = self.packer.pack(tensors, buf, slot, at=at)
            at += region(data.numel())
            starts = [0, *itertools.accumulate(t.nbytes for t in tensors)]
            for first, end in threshold_chunks([t.nbytes for t in tensors], self.chunk_limit):
                works.append(self.group.broadcast(data[starts[first] : starts[end]]))
        return _Pending(self, bucket, works, futures)


# -------------------------------------------------------------------------------------- ipc backend
def gpu_uuid(device) -> str:
    """The key of a CUDA IPC handle for vLLM's ipc backend: the GPU's UUID as its workers spell it
    (``str(torch.cuda.get_device_properties(index).uuid)``), the same whatever ``CUDA_VISIBLE_DEVICES``."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


class CudaIpcShares:
    """CUDA IPC handles (``reduce_tensor``'s argument tuples) of the tensors one request shares.

    torch's sharing wraps the shared *storage* object in a new reference-counted record each time
    (released with the storage object) and the consumer decrements that record's counter once per
    handle it opens; vLLM's workers open every handle anew. Sharing the long-lived export buffers
    themselves would therefore either pile up records for the buffers' lifetime or reuse a handle
    whose counter the worker then takes below zero. So each storage is shared through a fresh alias
    (a new storage object over the same memory, ``torch.from_dlpack``): its records and counters go
    with it once the engine has acknowledged the request and :attr:`keep` is dropped."""

    def __init__(self):
        self.keep: dict[int, torch.Tensor] = {}  # storage address -> its alias for this request

    def __call__(self, t: torch.Tensor) -> tuple:
        from torch.multiprocessing.reductions import reduce_tensor

        storage = t.untyped_storage()
        alias = self.keep.get(storage.data_ptr())
        if alias is None:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            alias = self.keep[storage.data_ptr()] = torch.from_dlpack(whole)
        start = t.storage_offset() * t.element_size()
        _, args = reduce_tensor(alias[start : start + t.nbytes].view(t.dtype).view(t.shape))
        return args


def require_cuda(device, what: str) -> None:
    """CUDA IPC shares CUDA memory only: ValueError naming the device otherwise."""
    if device is None or torch.device(device).type != "cuda":
        raise ValueError(
            f"the vllm-ipc adapter shares {what} with a vLLM engine on the same GPU through CUDA IPC, which needs "
            f"CUDA tensors; got {what} on {device}: export from a CUDA model, or use the 'vllm' adapter (nccl)"
        )


class VllmIpcSender(_WeightTransferSession):
    """vLLM's weight-transfer engine with the ``ipc`` backend: an engine on the trainer's GPU reads
    the export buffers through CUDA IPC handles carried by ``update_weights`` (see the module
    docstring). The engine's answer to a request is its acknowledgement: the worker has loaded the
    weights and synchronized, so the export buffer (and staging) behind it may be written again.

    ``call``: the engine's calls (``init_weight_transfer_engine``, ``start_weight_update``,
    ``update_weights``, ``finish_weight_update``; ``get_weight_version`` with ``check_version``).
    ``packed``: one handle per tensor (False, vLLM's default) or per request with ``tensor_sizes``
    (True); it must match the engine (``packed_params_in``: ``"init_info"``, default, vLLM main;
    ``"engine_config"``; ``"update_info"``). ``pickle_handles``: send ``ipc_handles_pickled``
    (base64 pickle, for a ``call`` that posts JSON; the engine needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) instead of ``ipc_handles``. ``timeout_s``: the bound
    of every wait (default 120). The export buffers must be CUDA tensors of this GPU, which every
    engine worker must share (the handles are keyed by its UUID)."""

    after_failure = (
        "the engine may hold a partly written version; close it, build a new adapter (it calls "
        "init_weight_transfer_engine again) and refit before serving"
    )

    def __init__(
        self,
        call: EngineCall,
        *,
        packed: bool = False,
        packed_params_in: str = "init_info",
        pickle_handles: bool = False,
        check_version: bool = False,
        timeout_s: float = 120.0,
    ):
        super().__init__(
            call, packed=packed, packed_params_in=packed_params_in, check_version=check_version, timeout_s=timeout_s
        )
        if not isinstance(pickle_handles, bool):
            raise ValueError(f"pickle_handles must be True or False, got {pickle_handles!r}")
        self.pickle_handles = pickle_handles
        self._uuids: dict[torch.device, str] = {}

    # The three CUDA-bound steps, one method each (CPU tests replace them with stand-ins).
    def _require_cuda(self, device, what: str) -> None:
        require_cuda(device, what)

    def _gpu_uuid(self, device: torch.device) -> str:
        if device not in self._uuids:
            self._uuids[device] = gpu_uuid(device)
        return self._uuids[device]

    def _shares(self) -> CudaIpcShares:
        return CudaIpcShares()

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        self._require_cuda(device, "the export buffers")
        return super().allocate(nbytes, device)

    def start(self, plan, buffers, version: int) -> None:
        for b in buffers:
            self._require_cuda(b.device, "the export buffers")
        super().start(plan, buffers, version)

    def _connect(self) -> None:
        self.calls.run("init_weight_transfer_engine", init_info=self._init_info())

    def _handles(self, handles) -> dict:
        if self.pickle_handles:
            return {"ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("utf-8")}
        return {"ipc_handles": handles}

    def _send(self, bucket: BucketMeta, buf: torch.Tensor, slot: int) -> _Pending:
        self._require_cuda(buf.device, "the export buffers")
        if self.packed:
            requests, at = [], 0
            for tensors in aligned_requests(bucket.tensors):
                data = self.packer.pack(tensors, buf, slot, at=at)
                at += region(data.numel())
                requests.append((tensors, data))
        else:
            requests = [(bucket.tensors, None)]
        if buf.is_cuda:  # the gather's and the packing's writes land before the engine reads
            torch.cuda.current_stream(buf.device).synchronize()
        uuid, share, futures = self._gpu_uuid(buf.device), self._shares(), []
        for tensors, data in requests:
            if data is None:
                fields = self._handles([{uuid: share(t.view(buf))} for t in tensors])
            else:
                fields = {**self._handles({uuid: share(data)}), "tensor_sizes": [t.nbytes for t in tensors]}
            futures.append(self.calls.submit("update_weights", update_info=self._update_info(tensors, **fields)))
        return _Pending(self, bucket, (), futures, keep=share.keep)


class VllmWorkerExtensionSender(_VllmGroupSender):
    """The ``collective_rpc`` route: a worker extension's ``init_weight_update_group(master_address,
    master_port, rank_offset, world_size)`` once, then ``update_weight(name, dtype_name, shape)`` per
    tensor (positional arguments), each receiving one broadcast of that tensor in its dtype.
    ``init_method`` / ``update_method`` rename the two methods; ``version_method`` (optional) is
    called with ``str(version)`` after the last tensor of a version. ``master_address``,
    ``master_port``, ``engine_ranks``, ``group``, ``timeout_s``: as :class:`VllmWeightTransferSender`'s."""

    what = "the vLLM workers"

    def __init__(
        self,
        call: EngineCall,
        *,
        init_method: str = "init_weight_update_group",
        update_method: str = "update_weight",
        version_method: str | None = None,
        **group_kwargs,
    ):
        super().__init__(call, **group_kwargs)
        for name, value in (("init_method", init_method), ("update_method", update_method)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must name the worker extension's method, got {value!r}")
        self.init_method, self.update_method, self.version_method = init_method, update_method, version_method

    def _connect(self) -> None:
        port = self._port()
        self._rendezvous(self.calls.submit(self.init_method, self.master_address, port, 1, self.world_size))

    def _send(self, bucket: BucketMeta, buf: torch.Tensor, slot: int) -> _Pending:
        works, futures = [], []
        for t in bucket.tensors:
            futures.append(self.calls.submit(self.update_method, t.name, dtype_str(t.dtype), list(t.shape)))
            works.append(self.group.broadcast(t.view(buf)))
        return _Pending(self, bucket, works, futures)

    def _finish(self, version: int) -> int:
        if self.version_method:
            self.calls.run(self.version_method, str(version))
        return version
