"""NCCL symmetric-memory staging buffers for experimental FSDP and DDP buckets.

- :class:`SymmMemConfig` / :func:`add_fsdp_symm_args`: mode (auto/on/off) and the
  per-collective size bands where symmetric kernels win.
- :func:`decide`: the per-bucket policy; :func:`probe`: can a group use it.
- :func:`resolve_config` / :func:`measure_bands` / :func:`load_bands`: bands
  measured on the machine that runs (``bands="probe"``), cached in a JSON file.
- :class:`SymmMemDistributedDataParallel` / :class:`SymmMemDDPMixin` /
  :func:`stage_ddp_buffers`: Megatron DDP buckets on symmetric buffers.
- :func:`fully_shard`: megatron-core's experimental FSDP entry point whose
  all-gathers and reduce-scatters run on symmetric send *and* receive buffers.
- :func:`release_symmetric_memory`: free a staged model's buffers on every rank
  at the same point (before building another staged model in the process).

Megatron-dependent pieces are imported lazily so the config can be used alone.
"""

from .capability import Capability, probe
from .config import BANDS, COLLECTIVES, MODES, SymmMemConfig, add_fsdp_symm_args
from .memory import SymmetricPlacementMismatch, SymmetricRegistrationError, window_stats
from .policy import Decision, decide, format_report
from .probe import BandProbeError, MeasuredBands, bands_from_timings, load_bands, measure_bands, resolve_config

__all__ = [
    "BANDS",
    "COLLECTIVES",
    "MODES",
    "BandProbeError",
    "Capability",
    "Decision",
    "MeasuredBands",
    "SymmMemConfig",
    "SymmMemDDPMixin",
    "SymmMemDistributedDataParallel",
    "SymmParamAndGradBuffer",
    "SymmetricPlacementMismatch",
    "SymmetricRegistrationError",
    "add_fsdp_symm_args",
    "bands_from_timings",
    "decide",
    "format_report",
    "fully_shard",
    "load_bands",
    "measure_bands",
    "probe",
    "release_symmetric_memory",
    "resolve_config",
    "stage_ddp_buffers",
    "window_stats",
]

_LAZY = {
    "SymmMemDDPMixin": "ddp",
    "SymmMemDistributedDataParallel": "ddp",
    "SymmParamAndGradBuffer": "ddp",
    "stage_ddp_buffers": "ddp",
    "release_ddp_buffers": "ddp",
    "fully_shard": "fsdp",
    "SymmFsdpModule": "fsdp",
    "SymmFsdpParameterGroup": "fsdp",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def release_symmetric_memory(model) -> int:
    """Free the staged buffers of ``model`` and return the bytes freed.

    ``model``: a Megatron DDP staged by this package (:class:`SymmMemDDPMixin`
    or :func:`stage_ddp_buffers`), or a module containing modules sharded with
    :func:`fully_shard`. Call it on every rank at the same point before dropping
    a staged model: the symmetric buffers go back to the pool, still registered,
    in the same state on every rank, so the next staged model reuses them
    without new NCCL windows. (Left to Python's garbage collector, the ranks
    free them at different times, and the next model's buffers may land at
    different places of the ranks' pools.) The model is unusable afterwards.
    """
    freed = 0
    if isinstance(getattr(model, "buffers", None), list):  # Megatron DDP
        from .ddp import release_ddp_buffers

        freed += release_ddp_buffers(model)
    modules = model.modules() if hasattr(model, "modules") else ()
    for module in modules:
        release = getattr(module, "release_symmetric_memory", None)
        if release is not None and hasattr(module, "_parameter_groups"):
            freed += release()
    return freed
