"""megatron_ext: a Megatron-Core plugin.

Subpackages:
- ``megatron_ext.nonuniform_tp``: nonuniform tensor parallelism (training goes on
  at reduced TP in replicas that lost GPUs).
- ``megatron_ext.fsdp_symm``: NCCL symmetric-memory staging buffers.
- ``megatron_ext.weight_export``: streams bucketed weights to inference engines.
- ``megatron_ext.testing``: test support only (multi-rank launcher, CPU shims for
  Megatron-Core, a tiny GPT). Product modules never import it.
"""

__version__ = "0.1.0"

# The megatron-core releases this version is built and tested against.
SUPPORTED_MEGATRON_CORE = ">=0.19,<0.20"
