"""The one Megatron-Core GPT -> Hugging Face name table (Llama / Qwen2 / Qwen3 / Qwen3-MoE).

Every capability that needs a Megatron name's HF counterpart reads it here: the
refit layouts' specs (:func:`.spec.gpt_specs`, which the export hook and the reshard
refit both plan with) and the engines' fused names. An entry
is ``(kind, HF names, TP dim)``: ``kind`` is ``"copy"`` (one HF tensor),
``"qkv"`` (Megatron's ``[q heads; k; v]`` per query group -> ``q/k/v_proj``) or
``"glu"`` (``[gate; up]`` -> ``gate/up_proj``); the TP dim is the dim of the
Megatron tensor that tensor parallelism shards (None: replicated).
"""

from __future__ import annotations


__all__ = [
    "ENGINE_FUSED",
    "EXPERT_NAMES",
    "GLOBAL_NAMES",
    "LAYER_NAMES",
    "engine_name",
    "global_layer_names",
    "global_name",
    "unwrap",
]

# Per-layer Megatron suffix -> (kind, HF names relative to ``model.layers.{i}.``, TP dim).
# Transformer Engine layer specs fuse the layernorms into the next linear (``*.layer_norm_weight``).
LAYER_NAMES = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",), None),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",), None),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        0,
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        0,
    ),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",), None),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",), None),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",), 1),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",), None),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",), None),
    "mlp.linear_fc1.weight": ("glu", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0),
    "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",), 1),
    "mlp.router.weight": ("copy", ("mlp.gate.weight",), None),
}
# One expert's weights: Megatron ``linear_fc{1,2}`` -> HF names relative to ``model.layers.{i}.mlp.experts.{e}.``
# (expert TP shards fc1 rows and fc2 columns, like the dense MLP).
EXPERT_NAMES = {
    "linear_fc1": ("glu", ("gate_proj.weight", "up_proj.weight"), 0),
    "linear_fc2": ("copy", ("down_proj.weight",), 1),
}
# Whole-model Megatron name -> (kind, HF names, TP dim); vocabulary rows are TP-sharded (padded).
GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": ("copy", ("model.embed_tokens.weight",), 0),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",), None),
    "output_layer.weight": ("copy", ("lm_head.weight",), 0),
}
# The module an inference engine (vLLM / SGLang) fuses each kind's HF tensors into.
ENGINE_FUSED = {"qkv": "qkv_proj", "glu": "gate_up_proj"}


def engine_name(hf_name: str, kind: str) -> str:
    """The engine's local tensor holding HF tensor ``hf_name`` of a fused ``kind``
    (``...self_attn.k_proj.weight`` -> ``...self_attn.qkv_proj.weight``)."""
    if kind == "copy":
        return hf_name
    *module, _, param = hf_name.split(".")
    return ".".join([*module, ENGINE_FUSED[kind], param])


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers. For the nonuniform-TP
    DDP that is the module forward runs (``compute_module``: on a degraded
    replica ``ddp.module`` is empty)."""
    while True:
        if hasattr(model, "compute_module"):
            model = model.compute_module
        elif hasattr(model, "module"):
            model = model.module
        else:
            return model


def global_layer_names(model) -> dict[str, str]:
    """Local ``decoder.layers.{j}.`` prefix -> global prefix (PP / VPP offsets)."""
    prefixes = {}
    decoder = getattr(model, "decoder", None)
    for j, layer in enumerate(getattr(decoder, "layers", [])):
        prefixes[f"decoder.layers.{j}."] = f"decoder.layers.{layer.layer_number - 1}."
    return prefixes


def global_name(name: str, prefixes: dict[str, str]) -> str:
    """``name`` with its local layer prefix replaced by the global one (``prefixes``:
    :func:`global_layer_names`)."""
    return next((gp + name[len(lp) :] for lp, gp in prefixes.items() if name.startswith(lp)), name)
