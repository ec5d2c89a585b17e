"""The ``transformers`` config with the shape of a Megatron ``TransformerConfig``
(Llama / Qwen2 / Qwen3 / Qwen3-MoE): what an engine loads to receive a refit."""

from __future__ import annotations

from .moe import qwen3_moe_kwargs

__all__ = ["hf_config_from_megatron"]


def hf_config_from_megatron(
    config,
    *,
    arch: str = "llama",
    vocab_size: int,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
):
    """A ``transformers`` config (Llama / Qwen2 / Qwen3 / Qwen3-MoE) with the shape of a
    Megatron ``TransformerConfig``. ``arch="qwen3_moe"`` also checks that Qwen3-MoE's
    router can reproduce Megatron's routing (:func:`.moe.qwen3_moe_kwargs`)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    heads = config.num_attention_heads
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=config.num_query_groups or heads,
        head_dim=config.kv_channels or config.hidden_size // heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=config.layernorm_epsilon,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        hidden_act="silu",
        attention_dropout=0.0,
    )
    if arch == "llama":
        kwargs.update(attention_bias=False, mlp_bias=False)
    if arch == "qwen3_moe":
        if not getattr(config, "num_moe_experts", None):
            raise ValueError("arch='qwen3_moe' needs a Megatron config with num_moe_experts set")
        kwargs.update(attention_bias=bool(config.add_qkv_bias), **qwen3_moe_kwargs(config))
    elif getattr(config, "num_moe_experts", None):
        raise ValueError(f"num_moe_experts={config.num_moe_experts}: use arch='qwen3_moe' (got {arch!r})")
    return classes[arch](**kwargs)
