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
- :func:`choose_arm` / :class:`StepAB` / :func:`step_ab_of`: ``auto`` decided by
  the training step (an in-job A/B of plain, the bands and every buffer
  symmetric, cached); :func:`choose_arm` is its decision rule.

Megatron-dependent pieces are imported lazily so the config can be used alone.
"""

from .capability import Capability, probe
from .config import BANDS, COLLECTIVES, DECIDE_BY, MODES, SymmMemConfig, add_fsdp_symm_args
from .memory import SymmetricPlacementMismatch, SymmetricRegistrationError, window_stats
from .policy import ARMS, Decision, arm_decisions, decide, format_report
from .probe import BandProbeError, MeasuredBands, bands_from_timings, load_bands, measure_bands, resolve_config
from .step_ab import ABChoice, ArmStats, StepAB, ab_schedule, arm_stats, choose_arm, noise_threshold_ms

__all__ = [
    "ARMS",
    "BANDS",
    "COLLECTIVES",
    "DECIDE_BY",
    "MODES",
    "ABChoice",
    "ArmStats",
    "BandProbeError",
    "Capability",
    "Decision",
    "StepAB",
    "MeasuredBands",
    "SymmMemConfig",
    "SymmMemDDPMixin",
    "SymmMemDistributedDataParallel",
    "SymmParamAndGradBuffer",
    "SymmetricPlacementMismatch",
    "SymmetricRegistrationError",
    "ab_schedule",
    "add_fsdp_symm_args",
    "arm_decisions",
    "arm_stats",
    "bands_from_timings",
    "choose_arm",
    "decide",
    "format_report",
    "fully_shard",
    "load_bands",
    "measure_bands",
    "noise_threshold_ms",
    "probe",
    "release_symmetric_memory",
    "resolve_config",
    "stage_ddp_buffers",
    "step_ab_of",
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


def step_ab_of(model) -> StepAB | None:
    """The step A/B (:class:`StepAB`) of a staged model: a DDP staged by
    :class:`SymmMemDDPMixin`, or a module holding modules sharded with
    :func:`fully_shard` (once its first forward has run); ``None`` when it has
    none (another mode, ``decide_by="bands"``, nothing that could be symmetric,
    or all arms alike). ``.state`` is ``"running"``, ``"decided"`` or
    ``"cached"``; ``.arm`` the arm in effect; ``.choice`` the decision with every
    arm's timings; ``.summary()`` all of it as a dict."""
    ab = getattr(model, "symm_mem_ab", None)
    if ab is not None:
        return ab
    for module in model.modules() if hasattr(model, "modules") else ():
        ab = getattr(module, "_symm_ab_root", None)
        if ab is not None:
            return ab
        for group in getattr(module, "_parameter_groups", ()):
            if getattr(group, "_symm_ab", None) is not None:
                return group._symm_ab
    return None
