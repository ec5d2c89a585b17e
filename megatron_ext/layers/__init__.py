"""Model layers for megatron-core's local layer spec (no Transformer Engine or Apex), used with and
without nonuniform TP.

- :mod:`.norm`: :class:`LocalNorm`, torch's LayerNorm / RMSNorm with sequence parallelism (its
  parameters marked so that ``finalize_model_grads`` sums their gradients over the TP group).
- :mod:`.gpt_spec`: :func:`local_gpt_block_spec`, the local GPT block with every norm a ``LocalNorm``;
  :func:`with_local_norms` for a spec built otherwise.
"""

from .gpt_spec import local_gpt_block_spec, with_local_norms
from .norm import NORMALIZATIONS, LocalNorm

__all__ = ["NORMALIZATIONS", "LocalNorm", "local_gpt_block_spec", "with_local_norms"]
