"""Test-only shims that let megatron-core 0.19 run on CPU ranks (gloo).

Megatron-Core calls ``torch.cuda`` unconditionally in a handful of places (the
RNG tracker, grad-buffer allocation, stream handling in the bucket group, and
``device='cuda'`` literals in the optimizer). :func:`install` redirects those
to CPU equivalents **in the current process only**. It is meant for test
processes and the CPU demo; product modules of ``megatron_ext`` never import
this module (a unit test enforces that).

Call sites covered (megatron-core 0.19.2):

- ``torch.cuda.current_device``: param_and_grad_buffer (grad/param buffers),
  utils.GlobalMemoryBuffer (attention), distrib_optimizer (state buffers).
- ``torch.cuda.{get_rng_state, manual_seed}``, ``tensor_parallel.random.
  _{get,set}_cuda_rng_state``: the model-parallel RNG tracker.
- ``torch.cuda.{current_stream, Stream, Event, stream}``: bucket group
  ``start_grad_sync`` / ``finish_grad_sync`` and DDP's communication stream.
- ``torch.cuda.{synchronize, empty_cache}``: DDP buffer offload helpers.
- ``torch.cuda.device(cpu)`` and ``Stream.device``: experimental FSDP's context.
- ``device='cuda'`` literals in optimizer/optimizer.py, optimizer/clip_grads.py,
  optimizer/grad_scaler.py, utils.local_multi_tensor_l2_norm and
  pipeline_parallel/schedules.py (the forward-backward functions' token count).
- ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks in the optimizer,
  distributed optimizer and clip_grads.
- ``Tensor.cuda()``: with pipeline stages and tied embeddings,
  ``LanguageModule.setup_embeddings_and_output_layer`` moves the shared weight
  with ``weight.data.cuda()`` before the first/last-stage all-reduce; on a
  CPU-only process it returns the CPU tensor itself (as does megatron-core's
  static-batching inference below).

:func:`install_inference` adds what megatron-core's static-batching inference
path (``StaticInferenceEngine(legacy=True)``, ``TextGenerationController``,
``GPTInferenceWrapper``) needs on top:

- ``Tensor.cuda()`` (installed by :func:`install`): ``generate_all_output_tokens_static_batch``
  moves its generated-length counter with ``torch.zeros(...).cuda()``.
- ``torch.cuda.Event(enable_timing=True).elapsed_time``: the controller times
  every step with CUDA events; CPU events time nothing (0 ms).
- ``device="cuda"`` in ``transformer.utils.get_default_causal_mask`` (the local
  ``DotProductAttention`` builds its causal mask there when the inference
  wrapper passes none, i.e. ``attention_backend`` other than ``local``).
- ``torch.distributed.all_to_all_single`` in ``tensor_parallel.mappings``: the
  MoE ``alltoall`` token dispatcher passes its split sizes as tensors, which
  gloo refuses (NCCL takes them); they reach gloo as lists.
"""

from __future__ import annotations

import contextlib
import logging
import types

import torch

_INSTALLED = False
_INFERENCE_INSTALLED = False


class _NullStream:
    """CPU stand-in for a CUDA stream: CPU work is already ordered."""

    device = torch.device("cpu")

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    """CPU stand-in for a CUDA event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _CpuTorch(types.ModuleType):
    """Stands in for the name ``torch`` inside a Megatron module: tensor factories
    asked for ``device='cuda'`` or ``pin_memory=True`` allocate plain CPU memory;
    everything else is real torch."""

    _FACTORIES = frozenset(
        {"tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like", "arange"}
    )

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)  # pinning needs the CUDA driver
            return attr(*args, **kwargs)

        return factory


class _ListSplitsTorch(types.ModuleType):
    """Stands in for ``torch`` inside ``tensor_parallel.mappings``: ``torch.distributed.all_to_all_single``
    gets its split sizes as lists (gloo refuses tensors); everything else is real torch."""

    def __init__(self):
        super().__init__("torch")
        self.distributed = types.SimpleNamespace(
            **{n: getattr(torch.distributed, n) for n in dir(torch.distributed) if not n.startswith("__")}
        )

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
            def as_list(s):
                return s.tolist() if isinstance(s, torch.Tensor) else s

            return torch.distributed.all_to_all_single(
                output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kwargs
            )

        self.distributed.all_to_all_single = all_to_all_single

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_torch_cuda():
    # Experimental FSDP enters ``torch.cuda.device(param.device)``; a CPU device
    # selects nothing.
    cuda_device = torch.cuda.device
    torch.cuda.device = lambda device=None: (
        contextlib.nullcontext() if device is None or str(device).startswith("cpu") else cuda_device(device)
    )
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    # The CUDA RNG maps onto the CPU default generator. (torch.manual_seed calls
    # torch.cuda.manual_seed_all, not manual_seed, so there is no recursion.)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))


def _patch_tensor_type():
    # Megatron's optimizers decide fp32 vs half params by comparing Tensor.type()
    # with 'torch.cuda.*Tensor' names; report CPU tensors under those names.
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    to_cuda = torch.Tensor.cuda

    def cuda(self, *args, **kwargs):
        return self if self.device.type == "cpu" else to_cuda(self, *args, **kwargs)

    torch.Tensor.cuda = cuda


def _patch_megatron():
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.grad_scaler as grad_scaler
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.utils as mutils

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    cpu_torch = _CpuTorch()
    for module in (optimizer, clip_grads, grad_scaler, mutils, schedules):
        module.torch = cpu_torch


class _SameGeneratorFilter(logging.Filter):
    """Drops megatron-core's "CPU RNG state changed within GPU RNG context": here the CUDA RNG
    *is* the CPU default generator (:func:`_patch_torch_cuda`), so every dropout inside the
    model-parallel RNG tracker's fork moves the CPU state by design, and the warning would
    repeat for every layer of every micro-batch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _quiet_rng_warning():
    for name in (
        "megatron.core.tensor_parallel.random",
        "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",
    ):
        logging.getLogger(name).addFilter(_SameGeneratorFilter())


def install() -> bool:
    """Install the CPU shims once in this process. Returns False (and does
    nothing) when CUDA is available, so GPU runs use real Megatron paths."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False
    _patch_torch_cuda()
    _patch_tensor_type()
    _patch_megatron()
    _quiet_rng_warning()
    _INSTALLED = True
    return True


def install_inference() -> bool:
    """:func:`install` plus the shims megatron-core's static-batching inference path
    needs on CPU (see the module docstring). Returns False (and does nothing) when
    CUDA is available."""
    global _INFERENCE_INSTALLED
    if not install():
        return False
    if _INFERENCE_INSTALLED:
        return True
    import megatron.core.transformer.utils as transformer_utils

    transformer_utils.torch = _CpuTorch()
    import megatron.core.tensor_parallel.mappings as mappings

    mappings.torch = _ListSplitsTorch()
    _INFERENCE_INSTALLED = True
    return True


def install_resharding() -> bool:
    """:func:`install` plus megatron-core's gloo copy service of ``swap_model_weights``
    (``megatron.core.resharding``), which stages every transfer in pinned host memory:
    plain CPU memory here. Returns False (and does nothing) when CUDA is available."""
    if not install():
        return False
    from megatron.core.resharding.copy_services import gloo_copy_service

    gloo_copy_service.torch = _CpuTorch()
    return True


def installed() -> bool:
    return _INSTALLED
