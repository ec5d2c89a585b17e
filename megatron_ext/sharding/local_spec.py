"""megatron-core's local layer spec without fused kernels, as ``TransformerConfig`` keyword arguments."""

from types import MappingProxyType

# The fusions need Apex / Transformer Engine (or CUDA): every model built on the local layer spec turns them off,
# as in TransformerConfig(..., **UNFUSED_LOCAL_SPEC).
UNFUSED_LOCAL_SPEC = MappingProxyType(
    {
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }
)
