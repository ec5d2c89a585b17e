"""Engine adapters: the export hook driving vLLM's and SGLang's own weight-update protocols.

Each adapter is a sender of :class:`~megatron_ext.weight_export.WeightExporter`
(the ``allocate / start / send / finish / abort / close`` protocol of
:mod:`~megatron_ext.weight_export.transports`), so the export plan, the gathers
and the buffers stay the hook's; only the last hop speaks the engine's
protocol. The engine-side calls go through a callable the user wires (an HTTP
POST, ``llm.collective_rpc``, a Ray actor method)::

    from megatron_ext.weight_export import RefitConfig, WeightExporter
    from megatron_ext.weight_export.engines.adapters import make_adapter

    adapter = make_adapter("sglang-distributed", call, master_address="10.0.0.5", engine_ranks=2)
    exporter = WeightExporter(model, RefitConfig(bucket_size_mb=256), sender=adapter)
    exporter.export(version=step)        # on every trainer rank; the export rank drives the engine

Registry (name -> adapter; modules imported on first use):

- ``vllm``: vLLM's weight-transfer engine, nccl backend (:class:`.vllm.VllmWeightTransferSender`);
- ``vllm-ipc``: vLLM's weight-transfer engine, ipc backend: an engine on the trainer's GPU reads
  the export buffers through CUDA IPC handles sent with ``update_weights``
  (:class:`.vllm.VllmIpcSender`);
- ``vllm-rpc``: a vLLM worker extension's ``update_weight`` per tensor through
  ``collective_rpc`` (:class:`.vllm.VllmWorkerExtensionSender`);
- ``sglang-distributed``: SGLang ``init_weights_update_group`` +
  ``update_weights_from_distributed`` (:class:`.sglang.SglangDistributedSender`);
- ``sglang-tensor``: SGLang ``update_weights_from_tensor`` with flattened buckets
  (:class:`.sglang.SglangTensorSender`).

See docs/engine_adapters.md for what each one sends and what was tested.
"""

from __future__ import annotations

import importlib

__all__ = [
    "ADAPTERS",
    "SglangDistributedSender",
    "SglangTensorSender",
    "VllmIpcSender",
    "VllmWeightTransferSender",
    "VllmWorkerExtensionSender",
    "adapter_class",
    "make_adapter",
]

# name -> (module of this package, class)
ADAPTERS = {
    "vllm": ("vllm", "VllmWeightTransferSender"),
    "vllm-ipc": ("vllm", "VllmIpcSender"),
    "vllm-rpc": ("vllm", "VllmWorkerExtensionSender"),
    "sglang-distributed": ("sglang", "SglangDistributedSender"),
    "sglang-tensor": ("sglang", "SglangTensorSender"),
}
_CLASSES = {cls: module for module, cls in ADAPTERS.values()}


def adapter_class(name: str) -> type:
    """The adapter class registered under ``name`` (its module is imported now)."""
    if name not in ADAPTERS:
        raise ValueError(f"unknown engine adapter {name!r}; choose one of {tuple(ADAPTERS)}")
    module, cls = ADAPTERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def make_adapter(name: str, call, **kwargs):
    """The adapter ``name`` driving the engine through ``call(method, *args, **kwargs)``."""
    return adapter_class(name)(call, **kwargs)


def __getattr__(attr: str):
    if attr in _CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{_CLASSES[attr]}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
