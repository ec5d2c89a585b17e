"""LocalNorm: megatron-core's local-spec norm (torch's ``LayerNorm`` / ``RMSNorm``) with sequence parallelism.

megatron-core 0.19 builds the norms of its local layer spec with ``WrappedTorchNorm``, which refuses
``sequence_parallel`` (only Transformer Engine's and Apex's fused norms support it). Under sequence
parallelism a norm sees only its TP rank's part of the sequence, so each TP rank holds a partial
gradient of its (replicated) parameters; Megatron's ``finalize_model_grads`` sums the gradients of
parameters marked ``sequence_parallel`` over the TP group (``_allreduce_non_tensor_model_parallel_grads``).
:class:`LocalNorm` builds torch's own norm, as ``WrappedTorchNorm`` does (same class, same parameter
names, same state dict), and marks its parameters the way the fused norms do.
"""

from __future__ import annotations

import torch

__all__ = ["NORMALIZATIONS", "LocalNorm"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class LocalNorm:
    """``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (by ``config.normalization``) over
    ``hidden_size``, each parameter with ``sequence_parallel = config.sequence_parallel``.

    A drop-in for ``WrappedTorchNorm`` in layer specs (megatron-core's norm builder signature; the
    unused arguments are accepted as there). Refused, naming the ``TransformerConfig`` field:
    ``layernorm_zero_centered_gamma``, ``persist_layer_norm`` and ``memory_efficient_layer_norm``
    (fused-kernel options torch's norms do not have), and a ``normalization`` other than
    :data:`NORMALIZATIONS`."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
        **kwargs,
    ) -> torch.nn.Module:
        for field in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, field, False):
                raise ValueError(
                    f"LocalNorm (torch's LayerNorm / RMSNorm) does not support TransformerConfig.{field}=True "
                    "(a fused-kernel option); set it to False"
                )
        kind = config.normalization
        if kind == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif kind == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"LocalNorm: TransformerConfig.normalization must be one of {NORMALIZATIONS}, got {kind!r}"
            )
        for param in norm.parameters():
            # finalize_model_grads sums these over the TP group when config.sequence_parallel is set
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
