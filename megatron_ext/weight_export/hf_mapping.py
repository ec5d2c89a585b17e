"""Megatron-Core GPT parameters -> Hugging Face tensors (Llama / Qwen2 / Qwen3 / Qwen3-MoE).

A :class:`Source` is one Megatron parameter as the trainer holds it: its global
name, the pipeline stage that owns it, how tensor parallelism shards it, and the
HF tensors it becomes. :func:`write_shard` writes one TP shard of a source
straight into the HF tensors' destination views, so assembling a full tensor
needs no temporary: QKV with GQA is split into ``q/k/v_proj``, the gated MLP's
``linear_fc1`` into ``gate/up_proj``, TE's fused layernorm weights become the
HF layernorms, and a tied output layer is exported once (as the embedding).
MoE layers (:mod:`.hf_moe`): the router becomes ``mlp.gate``, each local expert
of each expert-parallel rank one HF expert under its global index, whether the
experts are a ``SequentialMLP`` or Transformer Engine's ``TEGroupedMLP``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..sharding.megatron import shard_spec
from ..sharding.moe import UNSUPPORTED_HINTS, expert_hf_names, expert_param, grouped_expert_issue, qwen3_moe_kwargs, \
    router_issue
from ..sharding.names import GLOBAL_NAMES, LAYER, LAYER_NAMES, VOCAB_PARAMS, global_layer_names, unwrap

__all__ = ["CopyBatch", "Source", "UnsupportedParameter", "copy_all", "hf_config_from_megatron", "local_sources",
           "shard_copies",
           "write_shard"]


class UnsupportedParameter(ValueError):
    """A Megatron parameter has no Hugging Face counterpart in the GPT mapping."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One Megatron parameter and the HF tensors it becomes.

    ``kind`` is ``"copy"`` (one HF tensor), ``"qkv"`` (q, k, v) or ``"glu"``
    (gate, up). ``shard_shape`` is the shape on each TP rank; ``partition_dim``
    the sharded dim (None: replicated). ``outputs`` are ``(hf_name, shape)``.
    """

    mcore_name: str
    local_name: str
    pp_rank: int
    dtype: torch.dtype
    shard_shape: tuple[int, ...]
    partition_dim: int | None
    kind: str
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    num_heads: int = 0
    num_groups: int = 0
    expert: int | None = None
    ep_rank: int | None = None
    etp_size: int = 1  # experts: expert-TP ranks sharding it along partition_dim (1: whole)

    @property
    def group(self) -> str:
        """The process group that gathers it: ``"ep"`` for experts (the EP group, or
        Megatron's expert-tensor-and-model-parallel group with expert TP > 1), else ``"tp"``."""
        return "tp" if self.ep_rank is None else "ep"

    @property
    def shard_nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shard_shape:
            n *= d
        return n


def local_sources(model, *, pp_rank: int = 0, tp_size: int = 1, vocab_size: int | None = None,
                  ep_size: int = 1, etp_size: int = 1) -> list[Source]:
    """The :class:`Source` of every exported parameter of this rank's stage.

    ``vocab_size`` trims Megatron's padded vocabulary to the HF one. MoE models:
    experts are listed for every expert-parallel rank of the stage (``ep_size``;
    each rank holds ``num_moe_experts / ep_size`` under the same local names),
    after the dense parameters, each local expert weight once per EP rank in a
    row, ordered by layer, local expert, ``linear_fc1`` before ``linear_fc2``
    (SequentialMLP's order, also for TEGroupedMLP's ``weight{i}``). Raises
    :class:`UnsupportedParameter` naming the first parameter with no HF mapping.
    """
    model = unwrap(model)
    cfg = model.config
    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    prefixes = global_layer_names(model)
    num_heads = cfg.num_attention_heads
    num_groups = cfg.num_query_groups or num_heads
    head_dim = cfg.kv_channels or cfg.hidden_size // num_heads
    sources, experts = [], []
    for local_name, param in model.named_parameters():
        name = local_name
        for lp, gp in prefixes.items():
            if name.startswith(lp):
                name = gp + name[len(lp):]
                break
        if name == "output_layer.weight" and tied:
            continue  # the embedding is exported once; HF ties lm_head to it
        partition_dim = shard_spec(local_name, param, cfg.gated_linear_unit).dim if tp_size > 1 else None
        shard_shape = tuple(param.shape)
        full = list(shard_shape)
        if partition_dim is not None:
            full[partition_dim] *= tp_size
        m = LAYER.match(name)
        expert = expert_param(m.group(2)) if m else None
        if expert is not None:
            experts.append((int(m.group(1)), *expert, local_name, name, param))
            continue
        if m:
            layer, suffix = m.groups()
            if suffix not in LAYER_NAMES:
                raise UnsupportedParameter(_unsupported(name, cfg))
            if suffix == "mlp.router.weight" and router_issue(cfg):
                raise UnsupportedParameter(f"{name}: {router_issue(cfg)}")
            kind, hf, _ = LAYER_NAMES[suffix]
            hf = tuple(f"model.layers.{layer}.{h}" for h in hf)
        elif name in GLOBAL_NAMES:
            kind, hf, _ = GLOBAL_NAMES[name]
        else:
            raise UnsupportedParameter(_unsupported(name, cfg))
        if kind == "copy":
            if name in VOCAB_PARAMS and vocab_size is not None:
                if vocab_size > full[0]:
                    raise ValueError(f"vocab_size={vocab_size} exceeds {name}'s {full[0]} rows")
                full[0] = vocab_size
            shapes = (tuple(full),)
        elif kind == "qkv":
            rest = tuple(full[1:])
            shapes = ((num_heads * head_dim, *rest), (num_groups * head_dim, *rest),
                      (num_groups * head_dim, *rest))
        else:  # glu
            _check_gated(name, cfg)
            shapes = ((full[0] // 2, *full[1:]), (full[0] // 2, *full[1:]))
        sources.append(Source(
            mcore_name=name, local_name=local_name, pp_rank=pp_rank, dtype=param.dtype,
            shard_shape=shard_shape, partition_dim=partition_dim, kind=kind,
            outputs=tuple(zip(hf, shapes)), num_heads=num_heads, num_groups=num_groups,
        ))
    return sources + _expert_sources(experts, cfg, pp_rank=pp_rank, ep_size=ep_size, etp_size=etp_size)


def _expert_sources(experts, cfg, *, pp_rank: int, ep_size: int, etp_size: int) -> list[Source]:
    """Every EP rank's copy of each local expert weight.

    With expert TP (``etp_size`` > 1) each copy is sharded over the expert-TP
    ranks like a dense TP weight: ``linear_fc1`` on dim 0 (GLU: each shard
    ``[gate_r; up_r]``), ``linear_fc2`` on dim 1; ``shard_shape`` is one shard,
    ``outputs`` the whole expert's HF tensors.
    ``experts``: ``(layer, local index, fc, grouped, local name, global name, param)``.
    SequentialMLP and TEGroupedMLP hold the same per-expert tensors, so both give
    the same HF names and shapes; ``mcore_name`` keeps the trainer's naming with
    the global expert index.
    """
    if not experts:
        return []
    experts = sorted(experts, key=lambda x: (x[0], x[1], x[2]))  # layer, local expert, fc1 before fc2
    num_experts = getattr(cfg, "num_moe_experts", None) or 0
    if num_experts % ep_size:
        raise ValueError(f"num_moe_experts={num_experts} is not divisible by expert_model_parallel_size={ep_size}")
    num_local = num_experts // ep_size
    out = []
    for layer, local, fc, grouped, local_name, name, param in experts:
        if grouped and grouped_expert_issue(cfg):
            raise UnsupportedParameter(f"{name}: {grouped_expert_issue(cfg)}")
        if local >= num_local:
            raise ValueError(f"{name}: local expert {local} but num_moe_experts / EP = {num_local}; "
                             "pass the expert-parallel size the model was built with")
        shape = tuple(param.shape)
        partition_dim = None
        full = list(shape)
        if etp_size > 1:
            # Megatron's expert linears: column-parallel fc1 (dim 0), row-parallel fc2 (dim 1).
            partition_dim = 0 if fc == "linear_fc1" else 1
            if len(shape) != 2 or getattr(param, "partition_dim", partition_dim) != partition_dim:
                raise UnsupportedParameter(
                    f"{name}: expected an expert-TP shard split on dim {partition_dim}, got shape {shape}, "
                    f"partition_dim={getattr(param, 'partition_dim', None)}")
            full[partition_dim] *= etp_size
        if fc == "linear_fc1":
            _check_gated(name, cfg)
            kind, shapes = "glu", ((full[0] // 2, *full[1:]), (full[0] // 2, *full[1:]))
        else:
            kind, shapes = "copy", (tuple(full),)
        for r in range(ep_size):
            e = r * num_local + local
            out.append(Source(
                mcore_name=(f"decoder.layers.{layer}.mlp.experts.{fc}.weight{e}" if grouped
                            else f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{fc}.weight"),
                local_name=local_name, pp_rank=pp_rank, dtype=param.dtype, shard_shape=shape,
                partition_dim=partition_dim, kind=kind, outputs=tuple(zip(expert_hf_names(layer, e, fc), shapes)),
                expert=e, ep_rank=r, etp_size=etp_size))
    return out


def _check_gated(name: str, cfg) -> None:
    if not cfg.gated_linear_unit:
        raise UnsupportedParameter(
            f"{name}: non-gated MLP has no Llama/Qwen counterpart (set gated_linear_unit=True)")


def _unsupported(name: str, cfg) -> str:
    hint = ""
    for pattern, why in UNSUPPORTED_HINTS:
        if pattern.search(name):
            return f"Megatron parameter {name!r} has no Hugging Face counterpart: {why}"
    if name.endswith("layernorm.bias") or name.endswith("layer_norm_bias"):
        hint = " (LayerNorm with bias: Llama/Qwen use RMSNorm, set normalization='RMSNorm')"
    elif name.endswith(".bias"):
        hint = " (linear bias: Llama/Qwen have none except Qwen2's QKV bias; set add_bias_linear=False)"
    elif "position_embeddings" in name:
        hint = " (learned absolute positions: Llama/Qwen use RoPE, position_embedding_type='rope')"
    return f"Megatron parameter {name!r} has no Hugging Face counterpart in the GPT mapping{hint}"


def write_shard(source: Source, shard: torch.Tensor, tp_rank: int, tp_size: int,
                dests: list[torch.Tensor]) -> None:
    """Copy TP shard ``tp_rank`` of ``source`` into its place in the HF tensors ``dests``."""
    for dst, src in shard_copies(source, shard, tp_rank, tp_size, dests):
        dst.copy_(src)


def shard_copies(source: Source, shard: torch.Tensor, tp_rank: int, tp_size: int,
                 dests: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(destination view, source view)`` pairs that place TP shard ``tp_rank``
    of ``source`` in the HF tensors ``dests`` (batched by the caller)."""
    d = source.partition_dim
    if source.kind == "copy":
        (dst,) = dests
        if d is None:
            if tp_rank != 0:
                return []
            return [(dst, shard.narrow(0, 0, dst.shape[0]) if dst.shape[0] != shard.shape[0] else shard)]
        size = shard.shape[d]
        start = tp_rank * size
        stop = min(start + size, dst.shape[d])  # vocab trimming
        if stop <= start:
            return []
        return [(dst.narrow(d, start, stop - start), shard.narrow(d, 0, stop - start))]
    if d is not None and d != 0:
        raise ValueError(f"{source.mcore_name}: expected TP sharding on dim 0, got {d}")
    ranks = tp_size if d is not None else 1
    if d is None and tp_rank != 0:
        return []
    if source.kind == "glu":
        gate, up = dests
        rows = shard.shape[0] // 2
        return [(gate.narrow(0, tp_rank * rows, rows), shard[:rows]),
                (up.narrow(0, tp_rank * rows, rows), shard[rows:])]
    # qkv: rows are [q heads of group g, k of g, v of g] for each query group g.
    q, k, v = dests
    groups = source.num_groups // ranks
    per_group = source.num_heads // source.num_groups
    rest = tuple(shard.shape[1:])
    head_dim = shard.shape[0] // (groups * (per_group + 2))
    x = shard.reshape(groups, (per_group + 2) * head_dim, *rest)
    g0 = tp_rank * groups
    qd = per_group * head_dim
    return [
        (q.view(source.num_groups, qd, *rest)[g0:g0 + groups], x[:, :qd]),
        (k.view(source.num_groups, head_dim, *rest)[g0:g0 + groups], x[:, qd:qd + head_dim]),
        (v.view(source.num_groups, head_dim, *rest)[g0:g0 + groups], x[:, qd + head_dim:]),
    ]


class CopyBatch:
    """Many ``(dst, src)`` copies issued as few kernel launches, sorted once.

    ``torch._foreach_copy_`` launches one multi-tensor kernel only for a list of
    floating tensors that all share a dtype and whose pairs are dense with equal
    strides; one odd pair sends the whole list to a per-tensor loop (one launch
    and ~15 us of host time per pair). So the pairs are grouped: one foreach call
    per floating dtype for the dense pairs, plain ``copy_`` for the rest (strided
    views, integer tensors). Build once and :meth:`run` many times when the views
    are fixed (reshard buffers); :func:`copy_all` does both for one-off lists."""

    def __init__(self, pairs):
        groups: dict[torch.dtype, tuple[list, list]] = {}
        self.single: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            if (dst.dtype == src.dtype and dst.is_floating_point() and dst.device == src.device
                    and dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape):
                d, s = groups.setdefault(dst.dtype, ([], []))
                d.append(dst)
                s.append(src)
            else:
                self.single.append((dst, src))
        self.groups = list(groups.values())

    def __len__(self) -> int:
        return sum(len(d) for d, _ in self.groups) + len(self.single)

    def run(self) -> None:
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs)
        for dst, src in self.single:
            dst.copy_(src)


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run many copies as few kernel launches (:class:`CopyBatch`)."""
    if pairs:
        CopyBatch(pairs).run()


FINITE_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def finite_flags(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Whether each tensor is all finite, batched: per checked dtype (fp32, bf16, fp16, fp64),
    the indices of ``tensors`` of that dtype and their flags (a bool tensor on the device),
    from one fused max-abs reduction (a NaN or Inf survives a max). No host sync; tensors of
    other dtypes and empty ones are not checked."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dtype in FINITE_CHECKED_DTYPES and t.numel():
            groups.setdefault(t.dtype, []).append(i)
    return [(idx, torch.stack(torch._foreach_norm([tensors[i] for i in idx], float("inf"))).isfinite())
            for idx in groups.values()]


def hf_config_from_megatron(config, *, arch: str = "llama", vocab_size: int, max_position_embeddings: int = 4096,
                            rope_theta: float = 10000.0, tie_word_embeddings: bool = False):
    """A ``transformers`` config (Llama / Qwen2 / Qwen3 / Qwen3-MoE) with the shape of a
    Megatron ``TransformerConfig``. ``arch="qwen3_moe"`` also checks that Qwen3-MoE's
    router can reproduce Megatron's routing (:func:`.hf_moe.qwen3_moe_kwargs`)."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    heads = config.num_attention_heads
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=heads,
        num_key_value_heads=config.num_query_groups or heads,
        head_dim=config.kv_channels or config.hidden_size // heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings, hidden_act="silu",
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
