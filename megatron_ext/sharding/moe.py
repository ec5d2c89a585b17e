"""Mixture-of-experts pieces of the Megatron -> Hugging Face mapping (Qwen3-MoE).

Each expert-parallel rank holds ``num_moe_experts / EP`` local experts, either
as Megatron's ``SequentialMLP`` (one module per expert:
``mlp.experts.local_experts.{i}.linear_fc{1,2}.weight``) or as Transformer
Engine's ``TEGroupedMLP`` (``moe_grouped_gemm=True``: numbered weights of one
grouped linear per projection, ``mlp.experts.linear_fc{1,2}.weight{i}``). Both
hold local expert ``i`` as the same tensors, ``linear_fc1`` ``[gate; up]``
``(2F, H)`` and ``linear_fc2`` ``(H, F)``, so both map alike. The HF checkpoint
names each expert by its global index ``e = ep_rank * num_local + i``
(``mlp.experts.{e}.gate_proj`` ...), which is what vLLM / SGLang
``load_weights`` take and what :func:`~.spec.gpt_specs` uses. ``transformers`` 5 stores a layer's experts as
two fused 3-D parameters; :func:`fused_expert_views` gives the per-expert views
into them so receivers can load per-expert names.
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "TOPK_BALANCING",
    "fused_expert_views",
    "grouped_expert_issue",
    "moe_layer_pattern",
    "qwen3_moe_kwargs",
    "router_issue",
]

# Load-balancing kinds under which Megatron routes at inference as a plain softmax top-k router (what Qwen3-MoE
# and megatron-core's engine here run); sinkhorn and quantile balancing route otherwise.
TOPK_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

# Expert weights we recognise but cannot map; each hint says what to do.
UNSUPPORTED_HINTS = (
    (
        re.compile(r"\.shared_experts\."),
        "shared experts (Qwen2-MoE / DeepSeek style) are not mapped to Qwen3-MoE; train without "
        "moe_shared_expert_intermediate_size or extend hf_moe.py",
    ),
    (
        re.compile(r"\.experts\.weight[12]$"),
        "legacy GroupedMLP weights (one (hidden, local experts x ffn) tensor per projection, transposed; "
        "removed in megatron-core 0.19) are not mapped; use TEGroupedMLP (Transformer Engine layer spec with "
        "moe_grouped_gemm=True) or SequentialMLP (moe_grouped_gemm=False)",
    ),
    (
        re.compile(r"\.experts\.linear_fc[12]\.weight$"),
        "TEGroupedMLP with moe_single_grouped_weight=True (all local experts in one grouped tensor) is not "
        "mapped; set moe_single_grouped_weight=False (one weight{i} per local expert)",
    ),
    (
        re.compile(r"\.experts\.(local_experts\.\d+\.linear_fc[12]\.bias|linear_fc[12]\.bias\d*)$"),
        "expert biases have no Qwen3-MoE counterpart; set add_bias_linear=False",
    ),
    (re.compile(r"\.mlp\.router\."), "only the router weight maps to Qwen3-MoE's mlp.gate.weight"),
)


def grouped_expert_issue(config) -> str | None:
    """Why TEGroupedMLP's expert weights under ``config`` are not ``[gate; up]`` /
    plain per-expert tensors; None when they are."""
    interleave = getattr(config, "moe_mlp_glu_interleave_size", None)
    if interleave is not None and getattr(config, "gated_linear_unit", False):
        return (
            f"moe_mlp_glu_interleave_size={interleave!r} interleaves gate and up rows in blocks, which "
            "Qwen3-MoE's gate_proj / up_proj do not; set moe_mlp_glu_interleave_size=None"
        )
    return None


def router_issue(config) -> str | None:
    """Why Qwen3-MoE's router (softmax, top-k, optional renormalisation) cannot
    reproduce Megatron's routing under ``config``; None when it can."""
    checks = (
        ("moe_router_score_function", "softmax", "Qwen3-MoE routes with softmax scores"),
        ("moe_router_num_groups", None, "group-limited routing has no Qwen3-MoE counterpart"),
        ("moe_router_group_topk", None, "group-limited routing has no Qwen3-MoE counterpart"),
        ("moe_router_topk_scaling_factor", None, "Qwen3-MoE does not scale routing weights"),
        ("moe_router_enable_expert_bias", False, "the router's expert_bias buffer has no Qwen3-MoE counterpart"),
        ("moe_apply_probs_on_input", False, "Qwen3-MoE weights expert outputs, not inputs"),
        ("moe_latent_size", None, "latent MoE projections have no Qwen3-MoE counterpart"),
    )
    for field, want, why in checks:
        got = getattr(config, field, want)
        if got != want:
            return f"{field}={got!r} is not supported ({why}); set {field}={want!r}"
    balancing = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    routed_otherwise = set([balancing] if isinstance(balancing, str) else balancing) - set(TOPK_BALANCING)
    if routed_otherwise:
        return (
            f"moe_router_load_balancing_type={balancing!r} is not supported (Megatron routes "
            f"{sorted(routed_otherwise)} otherwise than Qwen3-MoE's softmax top-k at inference); use "
            f"{', '.join(TOPK_BALANCING[:-1])} or {TOPK_BALANCING[-1]}"
        )
    return None


def moe_layer_pattern(config) -> list[bool]:
    """Which decoder layers are MoE layers (Megatron's ``moe_layer_freq``: an int k
    makes every k-th layer from layer 0 an MoE layer, a list gives 1/0 per layer)."""
    freq, n = getattr(config, "moe_layer_freq", 1), config.num_layers
    if isinstance(freq, int) and freq > 0:
        return [i % freq == 0 for i in range(n)]
    if isinstance(freq, (list, tuple)) and len(freq) == n and set(freq) <= {0, 1}:
        return [bool(x) for x in freq]
    raise ValueError(f"moe_layer_freq={freq!r} is not supported: give an int > 0 or a list of {n} 0/1 entries")


def qwen3_moe_kwargs(config) -> dict:
    """The MoE fields of a ``transformers.Qwen3MoeConfig`` for a Megatron ``TransformerConfig``.

    Megatron's default router (top-k of the logits, softmax over those k) equals
    Qwen3-MoE's softmax-then-top-k with ``norm_topk_prob=True``;
    ``moe_router_pre_softmax=True`` (softmax over all experts, no renormalisation)
    is ``norm_topk_prob=False``. Dense layers go to ``mlp_only_layers``.
    """
    issue = router_issue(config)
    if issue:
        raise ValueError(issue)
    if getattr(config, "moe_shared_expert_intermediate_size", None):
        raise ValueError("moe_shared_expert_intermediate_size is set: Qwen3-MoE has no shared experts")
    pattern = moe_layer_pattern(config)
    return dict(
        num_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
        norm_topk_prob=not config.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
    )


def fused_expert_views(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Per-expert HF names -> views into ``transformers``' fused expert parameters.

    A module with 3-D ``gate_up_proj`` (E, 2I, H) = ``[gate; up]`` per expert and
    ``down_proj`` (E, H, I) (transposed layouts: (E, H, 2I) / (E, I, H)) yields
    ``{prefix}.{e}.gate_proj.weight`` -> ``gate_up_proj[e, :I]``, ``up_proj`` ->
    ``gate_up_proj[e, I:]`` and ``down_proj`` -> ``down_proj[e]``. Returns the views
    and the fused parameter names they replace. Interleaved or biased layouts
    are left alone (a plan check then names the expert tensor it cannot place).
    """
    views, fused = {}, set()
    for prefix, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        fused_3d = all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in (gate_up, down))
        plain = getattr(module, "is_concatenated", True) and getattr(module, "has_gate", True)
        if not fused_3d or not plain or getattr(module, "has_bias", False):
            continue
        transposed = getattr(module, "is_transposed", False)
        gate_up, down = gate_up.detach(), down.detach()
        for e in range(gate_up.shape[0]):
            gu = gate_up[e].t() if transposed else gate_up[e]  # (2I, H)
            inter = gu.shape[0] // 2
            views[f"{prefix}.{e}.gate_proj.weight"] = gu[:inter]
            views[f"{prefix}.{e}.up_proj.weight"] = gu[inter:]
            views[f"{prefix}.{e}.down_proj.weight"] = down[e].t() if transposed else down[e]
        fused |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    return views, fused
