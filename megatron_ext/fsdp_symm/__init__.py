"""NCCL symmetric-memory staging buffers for experimental FSDP and DDP buckets.

- :class:`SymmMemConfig` / :func:`add_fsdp_symm_args`: mode (auto/on/off) and the
  per-collective size bands where symmetric kernels win.
- :func:`decide`: the per-bucket policy; :func:`probe`: can a group use it.
- :class:`SymmMemDistributedDataParallel` / :class:`SymmMemDDPMixin` /
  :func:`stage_ddp_buffers`: Megatron DDP buckets on symmetric buffers.
- :func:`fully_shard`: megatron-core's experimental FSDP entry point whose
  all-gathers and reduce-scatters run on symmetric send *and* receive buffers.

Megatron-dependent pieces are imported lazily so the config can be used alone.
"""

from .capability import Capability, probe
from .config import COLLECTIVES, MODES, SymmMemConfig, add_fsdp_symm_args
from .policy import Decision, decide, format_report

__all__ = [
    "COLLECTIVES", "MODES", "Capability", "Decision", "SymmMemConfig",
    "SymmMemDDPMixin", "SymmMemDistributedDataParallel", "SymmParamAndGradBuffer",
    "add_fsdp_symm_args", "decide", "format_report", "fully_shard", "probe",
    "stage_ddp_buffers",
]

_LAZY = {
    "SymmMemDDPMixin": "ddp", "SymmMemDistributedDataParallel": "ddp",
    "SymmParamAndGradBuffer": "ddp", "stage_ddp_buffers": "ddp",
    "fully_shard": "fsdp", "SymmFsdpModule": "fsdp", "SymmFsdpParameterGroup": "fsdp",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
