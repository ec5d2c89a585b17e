"""What a model's Hugging Face tensors are and how both sides place them (no communication).

:class:`TensorSpec` lists one HF tensor with its placement facts: the dim tensor
parallelism shards, the layer, the expert, Megatron's padded vocabulary rows,
and the local tensors that hold it on the trainer (Megatron's name) and on an
engine (the vLLM-style fused name). :func:`gpt_specs` builds them from the name
table in :mod:`.names`; :func:`specs_from_model` reads a built Megatron model.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import torch

from .moe import UNSUPPORTED_HINTS, grouped_expert_issue, moe_layer_pattern, router_issue
from .names import EXPERT_NAMES, GLOBAL_NAMES, LAYER_NAMES, engine_name, global_layer_names, global_name, unwrap

__all__ = ["TensorSpec", "UnsupportedParameter", "gpt_specs", "specs_from_config", "specs_from_model"]


class UnsupportedParameter(ValueError):
    """A Megatron parameter has no Hugging Face counterpart in the GPT name table
    (the message names it and says which setting to change)."""


# Parameters of common Megatron GPT variants that Llama / Qwen do not have, and what to change.
_HINTS = UNSUPPORTED_HINTS + (
    (
        re.compile(r"layernorm\.bias$|layer_norm_bias$"),
        "LayerNorm with bias: Llama/Qwen use RMSNorm, set normalization='RMSNorm'",
    ),
    (
        re.compile(r"position_embeddings"),
        "learned absolute positions: Llama/Qwen use RoPE, set position_embedding_type='rope'",
    ),
    (re.compile(r"\.bias$"), "linear bias: Llama/Qwen have none except Qwen2's QKV bias; set add_bias_linear=False"),
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor: full shape, dtype and how both sides place it.

    ``tp_dim``: the dim tensor parallelism shards (None: replicated). ``layer``:
    the decoder layer (None: embedding / final norm / lm_head; the embedding is
    on the first stage, the rest on the last). ``expert``: the expert index of
    an expert's tensor. ``padded_rows``: Megatron's padded vocabulary rows (the
    trainer splits the padded rows; the HF tensor keeps the first ``shape[0]``).
    ``fused``: ``(kind, part)`` for tensors fused on both sides, kind ``"qkv"``
    (part 0/1/2 = q/k/v) or ``"glu"`` (0/1 = gate/up); ``megatron_name`` and
    ``engine_name`` are the local tensors holding it on each side.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int | None
    megatron_name: str
    engine_name: str
    layer: int | None = None
    expert: int | None = None
    padded_rows: int | None = None
    fused: tuple[str, int] | None = None
    num_heads: int = 0
    num_groups: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict:
        """Plain JSON data (the trainer publishes its specs to a refit engine that has none)."""
        return {**dataclasses.asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_json(cls, data: dict) -> "TensorSpec":
        """The spec :meth:`to_json` described; ValueError on anything else."""
        try:
            dtype = getattr(torch, data["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise TypeError(data["dtype"])
            fused = data.get("fused")
            return cls(
                **{**data, "dtype": dtype, "shape": tuple(data["shape"]), "fused": tuple(fused) if fused else None}
            )
        except (AttributeError, KeyError, TypeError) as exc:
            raise ValueError(f"not a TensorSpec description: {data!r} ({exc})") from None


def gpt_specs(
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_groups: int,
    head_dim: int,
    ffn_hidden_size: int,
    vocab_size: int,
    padded_vocab_size: int | None = None,
    tie_embeddings: bool = False,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    num_experts: int = 0,
    moe_ffn_hidden_size: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    te_layernorm: bool = False,
    grouped_gemm: bool = False,
    moe_layers: Sequence[bool] | None = None,
) -> list[TensorSpec]:
    """The HF tensors of a Llama / Qwen2 / Qwen3 (MoE: Qwen3-MoE) model with
    their Megatron and engine (vLLM-style fused) local names.

    ``moe_layers``: with ``num_experts``, which layers are MoE layers (one bool per
    layer, :func:`~.moe.moe_layer_pattern` of Megatron's ``moe_layer_freq``); the
    others are dense MLPs of ``ffn_hidden_size``, Qwen3-MoE's ``mlp_only_layers``
    (``model.layers.{i}.mlp.gate_proj`` ...). None: every layer an MoE layer.

    ``te_layernorm``: Megatron's Transformer Engine layer specs fuse the
    layernorms into the next linear layer, so ``input_layernorm`` is held as
    ``self_attention.linear_qkv.layer_norm_weight`` and (dense MLP only)
    ``post_attention_layernorm`` as ``mlp.linear_fc1.layer_norm_weight``.

    ``grouped_gemm``: experts in Megatron's ``TEGroupedMLP`` (TE layer specs with
    ``moe_grouped_gemm=True``), which holds expert ``j`` of an EP rank as
    ``mlp.experts.linear_fc1.weight{j}`` (``[gate; up]``, ``(2 * moe_ffn, hidden)``)
    and ``mlp.experts.linear_fc2.weight{j}`` (``(hidden, moe_ffn)``) instead of
    SequentialMLP's ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight``; the
    bytes are the same. Specs carry the global expert index; the layout renames
    it to the index within the EP rank."""
    if moe_layers is not None and len(moe_layers) != num_layers:
        raise ValueError(f"moe_layers has {len(moe_layers)} entries, one per layer of num_layers={num_layers} expected")
    specs: list[TensorSpec] = []
    pv = padded_vocab_size if padded_vocab_size and padded_vocab_size != vocab_size else None
    heads = dict(num_heads=num_heads, num_groups=num_groups)

    def add(entry, megatron_name: str, hf_prefix: str, shapes, **kw):
        kind, hf_names, tp_dim = entry
        for part, (hf, shape) in enumerate(zip(hf_names, shapes)):
            name = hf_prefix + hf
            fused = None if kind == "copy" else (kind, part)
            spec = TensorSpec(
                name, tuple(shape), dtype, tp_dim, megatron_name, engine_name(name, kind), fused=fused, **kw
            )
            specs.append(spec)

    def add_global(name: str, shape, **kw):
        add(GLOBAL_NAMES[name], name, "", [shape], **kw)

    q_rows, kv_rows = num_heads * head_dim, num_groups * head_dim
    add_global("embedding.word_embeddings.weight", (vocab_size, hidden_size), padded_rows=pv)
    for i in range(num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."

        def layer(suffix: str, shapes, _m=m, _h=h, _i=i, **kw):
            add(LAYER_NAMES[suffix], _m + suffix, _h, shapes, layer=_i, **kw)

        layer(
            "self_attention.linear_qkv.layer_norm_weight" if te_layernorm else "input_layernorm.weight",
            [(hidden_size,)],
        )
        layer(
            "self_attention.linear_qkv.weight",
            [(q_rows, hidden_size), (kv_rows, hidden_size), (kv_rows, hidden_size)],
            **heads,
        )
        if qkv_bias:
            layer("self_attention.linear_qkv.bias", [(q_rows,), (kv_rows,), (kv_rows,)], **heads)
        if qk_norm:
            layer("self_attention.q_layernorm.weight", [(head_dim,)])
            layer("self_attention.k_layernorm.weight", [(head_dim,)])
        layer("self_attention.linear_proj.weight", [(hidden_size, q_rows)])
        moe = bool(num_experts) and (moe_layers is None or bool(moe_layers[i]))
        fused_norm = te_layernorm and not moe  # MoE: TE keeps a separate pre_mlp_layernorm
        layer("mlp.linear_fc1.layer_norm_weight" if fused_norm else "pre_mlp_layernorm.weight", [(hidden_size,)])
        if moe:
            layer("mlp.router.weight", [(num_experts, hidden_size)])
            for e in range(num_experts):
                for fc, shapes in (
                    ("linear_fc1", [(moe_ffn_hidden_size, hidden_size)] * 2),
                    ("linear_fc2", [(hidden_size, moe_ffn_hidden_size)]),
                ):
                    megatron = (
                        m + f"mlp.experts.{fc}.weight{e}"
                        if grouped_gemm
                        else m + f"mlp.experts.local_experts.{e}.{fc}.weight"
                    )
                    add(EXPERT_NAMES[fc], megatron, h + f"mlp.experts.{e}.", shapes, layer=i, expert=e)
        else:
            layer("mlp.linear_fc1.weight", [(ffn_hidden_size, hidden_size)] * 2)
            layer("mlp.linear_fc2.weight", [(hidden_size, ffn_hidden_size)])
    add_global("decoder.final_layernorm.weight", (hidden_size,))
    if not tie_embeddings:
        add_global("output_layer.weight", (vocab_size, hidden_size), padded_rows=pv)
    return specs


def specs_from_config(
    config,
    *,
    vocab_size: int,
    padded_vocab_size: int | None = None,
    tie_embeddings: bool = False,
    dtype: torch.dtype | None = None,
    te_layernorm: bool = False,
    grouped_gemm: bool = False,
) -> list[TensorSpec]:
    """:func:`gpt_specs` for a Megatron ``TransformerConfig`` (dense or MoE: the layers
    ``moe_layer_freq`` makes MoE layers, the others dense MLPs; a ``moe_layer_freq`` that is
    neither an int > 0 nor a list of one 0/1 per layer is refused, naming it);
    ``te_layernorm=True`` for models built with Transformer Engine layer specs,
    ``grouped_gemm=True`` for TEGroupedMLP experts (TE specs with
    ``moe_grouped_gemm=True``; the local spec builds SequentialMLP either way)."""
    if grouped_gemm and config.num_moe_experts:
        issue = grouped_expert_issue(config)
        if issue is not None:  # the per-expert [gate; up] row ranges would be wrong
            raise ValueError(f"grouped-GEMM experts cannot be described: {issue}")
    heads = config.num_attention_heads
    return gpt_specs(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_groups=config.num_query_groups or heads,
        head_dim=config.kv_channels or config.hidden_size // heads,
        ffn_hidden_size=config.ffn_hidden_size,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size,
        tie_embeddings=tie_embeddings,
        qkv_bias=bool(config.add_qkv_bias),
        qk_norm=bool(config.qk_layernorm),
        num_experts=config.num_moe_experts or 0,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size or 0,
        dtype=dtype or config.params_dtype,
        te_layernorm=te_layernorm,
        grouped_gemm=grouped_gemm,
        moe_layers=moe_layer_pattern(config) if config.num_moe_experts else None,
    )


_LOCAL_EXPERT = re.compile(r"local_experts\.\d+\.")  # SequentialMLP: local_experts.{j}.linear_fc1.weight
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.weight)\d+$")  # TEGroupedMLP: linear_fc1.weight{j}


def _expert_pattern(name: str) -> str:
    """``name`` with the expert index within the EP rank replaced by ``*``."""
    return _GROUPED_EXPERT.sub(r"\g<1>*", _LOCAL_EXPERT.sub("local_experts.*.", name))


def specs_from_model(model, *, vocab_size: int, dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """:func:`specs_from_config` for a built Megatron GPT model (this rank's stage).

    Reads from the model what the config does not say: Transformer Engine's
    fused layernorm names, grouped-GEMM experts (TEGroupedMLP's
    ``linear_fc1.weight{j}``), the padded vocabulary (``model.vocab_size``),
    tied embeddings, and the parameters' dtype (unless ``dtype`` is given).
    Raises :class:`UnsupportedParameter` naming the first parameter the specs do
    not describe (e.g. legacy GroupedMLP's ``experts.weight1``, a LayerNorm bias)
    or that is split on another dim than the table says, and names the first layer
    that is not the kind (MoE or dense MLP) its config's ``moe_layer_freq`` says, so a
    layout never silently skips or misplaces a tensor.
    """
    m = unwrap(model)
    params = dict(m.named_parameters())
    prefixes = global_layer_names(m)

    cfg = m.config
    te = any(n.endswith("linear_qkv.layer_norm_weight") for n in params)
    grouped = any(_GROUPED_EXPERT.search(n) for n in params)
    router = next((n for n in params if n.endswith("mlp.router.weight")), None)
    if router is not None and router_issue(cfg):
        raise UnsupportedParameter(f"{global_name(router, prefixes)}: {router_issue(cfg)}")
    if grouped and cfg.num_moe_experts and grouped_expert_issue(cfg):
        name = global_name(next(n for n in params if _GROUPED_EXPERT.search(n)), prefixes)
        raise UnsupportedParameter(f"{name}: {grouped_expert_issue(cfg)}")
    if cfg.num_moe_experts:  # the layers the specs describe as MoE / dense are the ones the model built
        pattern = moe_layer_pattern(cfg)
        for j, built in enumerate(getattr(getattr(m, "decoder", None), "layers", [])):
            i, moe = built.layer_number - 1, f"decoder.layers.{j}.mlp.router.weight" in params
            if moe != pattern[i]:
                kinds = ("a dense MLP layer", "an MoE layer")
                raise UnsupportedParameter(
                    f"decoder.layers.{i} is {kinds[moe]}, but moe_layer_freq={cfg.moe_layer_freq!r} makes it "
                    f"{kinds[pattern[i]]}: build the model with its config's layer pattern (megatron-core's "
                    "get_gpt_decoder_block_spec(config, ...))"
                )
    padded = getattr(m, "vocab_size", None)
    if padded is not None and vocab_size > padded:
        raise ValueError(f"vocab_size={vocab_size} exceeds the model's {padded} (padded) vocabulary rows")
    specs = specs_from_config(
        cfg,
        vocab_size=vocab_size,
        padded_vocab_size=padded,
        tie_embeddings=bool(getattr(m, "share_embeddings_and_output_weights", False)),
        dtype=dtype or next(iter(params.values())).dtype,
        te_layernorm=te,
        grouped_gemm=grouped,
    )
    known = {_expert_pattern(s.megatron_name): s for s in specs}
    if not any(s.name == "lm_head.weight" for s in specs):
        known["output_layer.weight"] = None  # tied (a later stage's copy): the engine ties lm_head to the embedding
    for name, param in params.items():
        glob = global_name(name, prefixes)
        if _expert_pattern(glob) not in known:
            why = next((why for pattern, why in _HINTS if pattern.search(glob)), None)
            raise UnsupportedParameter(
                f"parameter {glob!r} has no Hugging Face counterpart: {why}"
                if why
                else f"parameter {glob!r} has no Hugging Face counterpart in the GPT name table (supported: Llama / "
                "Qwen2 / Qwen3 dense and MoE with local, sequential or TE grouped-GEMM experts, local or TE "
                "layer specs)"
            )
        spec = known[_expert_pattern(glob)]
        split = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
        if spec is not None and split is not None and split != spec.tp_dim:
            raise UnsupportedParameter(
                f"{glob}: split on dim {split} over tensor parallelism, but the name "
                f"table shards it on dim {spec.tp_dim}"
            )
    if not cfg.gated_linear_unit:
        raise UnsupportedParameter(
            "mlp.linear_fc1.weight: a non-gated MLP has no Llama/Qwen counterpart (set gated_linear_unit=True)"
        )
    return specs
