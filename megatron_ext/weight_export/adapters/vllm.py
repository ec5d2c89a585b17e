"""vLLM's weight-update protocols, driven from the export hook (trainer side).

Two protocols, each a sender of :class:`~..exporter.WeightExporter`
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

import contextlib
import itertools

import torch

from ..plan import BucketMeta
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
    "VllmWeightTransferSender",
    "VllmWorkerExtensionSender",
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


class VllmWeightTransferSender(_VllmGroupSender):
    """vLLM's weight-transfer engine (``nccl`` backend), one ``update_weights`` per bucket.

    ``call``: the engine's four calls (see the module docstring). ``master_address``: the
    trainer's address the workers can reach (the trainer hosts the rendezvous store there);
    ``master_port`` 0 picks a free port. ``engine_ranks``: the engine's workers (TP x PP x DP).
    ``packed`` / ``packed_params_in`` / ``packed_buffer_size_bytes`` / ``packed_num_buffers``: see
    the module docstring (sizes None: vLLM's defaults, not sent). ``check_version``: after
    ``finish_weight_update`` ask ``get_weight_version`` and require the version just sent.
    ``group``: see the module docstring; ``timeout_s``: the bound of every wait (default 120)."""

    what = "the vLLM engine"

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
        super().__init__(call, **group_kwargs)
        if not isinstance(packed, bool):
            raise ValueError(f"packed must be True or False, got {packed!r}")
        self.packed = packed
        self.packed_params_in = check_choice("packed_params_in", packed_params_in, PACKED_PARAMS_IN)
        self.packed_buffer_size_bytes, self.packed_num_buffers = packed_buffer_size_bytes, packed_num_buffers
        for name, value in self._sizes().items():
            if value is not None:
                check_int(name, value, 1)
        self.check_version = bool(check_version)
        self._open = False  # a version was started and not finished

    @property
    def chunk_limit(self) -> int:
        """The byte count past which the workers close a packed chunk."""
        return self.packed_buffer_size_bytes or VLLM_DEFAULT_PACKED_BUFFER_BYTES

    def _sizes(self) -> dict:
        return dict(packed_buffer_size_bytes=self.packed_buffer_size_bytes, packed_num_buffers=self.packed_num_buffers)

    def _wire_params(self) -> dict:
        return {"packed": self.packed, **{k: v for k, v in self._sizes().items() if v is not None}}

    def _connect(self) -> None:
        init_info = dict(
            master_address=self.master_address,
            master_port=self._port(),
            rank_offset=1,
            world_size=self.world_size,
        )
        if self.packed_params_in == "init_info":
            init_info.update(self._wire_params())
        self._rendezvous(self.calls.submit("init_weight_transfer_engine", init_info=init_info))

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

    def _update_info(self, tensors) -> dict:
        update_info = dict(
            names=[t.name for t in tensors],
            dtype_names=[dtype_str(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
        )
        if self.packed_params_in == "update_info":
            update_info.update(self._wire_params())
        return update_info

    def _finish(self, version: int) -> int:
        self._open = False
        self.calls.run("finish_weight_update", weight_version=str(version))
        if self.check_version:
            expect_version(self, self.calls.run("get_weight_version"), version)
        return version


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
