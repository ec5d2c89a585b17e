"""Where every Hugging Face tensor lives, described the same way on the trainer
and on the inference side.

Coordinates are always the *Hugging Face* tensor's (``q_proj``, ``gate_proj``,
one tensor per expert, ...). A rank holds a :class:`Box` of an HF tensor (a
``[start, stop)`` range per dim) inside one of its *local* tensors. A local
tensor is a stack along dim 0 of :class:`Segment` s, which is how fused tensors
are described without gathering: Megatron's ``linear_qkv`` shard is
``[q_g; k_g; v_g]`` per local query group, its ``linear_fc1`` shard
``[gate_r; up_r]``, and an inference engine's ``qkv_proj`` / ``gate_up_proj``
shard ``[q_r; k_r; v_r]`` / ``[gate_r; up_r]``.

:class:`TensorSpec` lists the model's HF tensors with their placement (which dim
tensor parallelism shards, the layer, the expert). :func:`megatron_layout` turns
them into the trainer's layout (TP x PP x DP, EP and expert TP for experts;
Megatron's rank order ``tp-dp-pp``, experts ``etp-ep-edp`` inside a stage),
:func:`inference_layout` into an engine's (TP x DP, optionally EP).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence

import torch

from .hf_mapping import _global_layer_names, unwrap
from .hf_moe import UNSUPPORTED_HINTS, grouped_expert_issue

__all__ = ["Box", "Layout", "LocalTensor", "Segment", "TensorSpec", "gpt_specs", "inference_layout",
           "megatron_expert_coords", "megatron_layout", "ntp_megatron_layout", "specs_from_config", "specs_from_model"]


@dataclasses.dataclass(frozen=True)
class Box:
    """``[start, stop)`` per dim of an HF tensor."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple((0, s) for s in shape))

    def replace(self, dim: int, start: int, stop: int) -> "Box":
        r = list(self.ranges)
        r[dim] = (start, stop)
        return Box(tuple(r))

    def intersect(self, other: "Box") -> "Box | None":
        r = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges))
        return None if any(a >= b for a, b in r) else Box(r)

    def contains(self, other: "Box") -> bool:
        return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.ranges)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


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
        return Box.full(self.shape).numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Segment:
    """``box`` of HF tensor ``name``, stored at row ``row`` of a local tensor."""

    name: str
    box: Box
    row: int


@dataclasses.dataclass(frozen=True)
class LocalTensor:
    """One tensor a rank holds: ``shape`` and its segments stacked on dim 0."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return Box.full(self.shape).numel * self.dtype.itemsize


@dataclasses.dataclass
class Layout:
    """A mesh of global ranks and, per rank, its local tensors.

    ``ranks`` are global ranks (of the job that moves the bytes); the two sides'
    ranks may be disjoint (separate GPUs) or overlap (colocated).
    """

    ranks: tuple[int, ...]
    tensors: dict[int, dict[str, LocalTensor]]
    specs: dict[str, TensorSpec]
    description: str = ""

    def holdings(self, name: str) -> list[tuple[int, str, Segment]]:
        """``(rank, local tensor, segment)`` of every copy of any part of HF tensor ``name``."""
        return self._index().get(name, [])

    def _index(self) -> dict[str, list[tuple[int, str, Segment]]]:
        if getattr(self, "_idx", None) is None:
            idx: dict[str, list] = {}
            for rank, locals_ in self.tensors.items():
                for lt in locals_.values():
                    for seg in lt.segments:
                        idx.setdefault(seg.name, []).append((rank, lt.name, seg))
            self._idx = idx
        return self._idx

    def segments(self, rank: int) -> Iterator[tuple[LocalTensor, Segment]]:
        for lt in self.tensors.get(rank, {}).values():
            for seg in lt.segments:
                yield lt, seg

    def hf_tensors(self, rank: int, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, view)`` of every HF tensor ``rank`` holds whole, as views
        into its local ``tensors`` (e.g. to load an engine replica into an HF
        model, or to feed ``load_weights`` after a refit)."""
        for lt, seg in self.segments(rank):
            if seg.box == Box.full(self.specs[seg.name].shape):
                n = seg.box.shape[0]
                yield seg.name, tensors[lt.name][seg.row:seg.row + n].view(self.specs[seg.name].shape)

    def bytes_held(self, rank: int) -> int:
        return sum(lt.nbytes for lt in self.tensors.get(rank, {}).values())


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``n`` split into ``parts`` (ceil-sized parts, last one clipped)."""
    size = -(-n // parts)
    return min(i * size, n), min((i + 1) * size, n)


def _stage_of(spec: TensorSpec, layer_stage: list[int], pp: int) -> int:
    if spec.layer is not None:
        return layer_stage[spec.layer]
    return 0 if "embed_tokens" in spec.name else pp - 1


def _tp_box(spec: TensorSpec, tp: int, r: int, *, megatron: bool, vocab_padding: int = 1) -> Box | None:
    """The box of ``spec`` on TP rank ``r`` of ``tp`` (None: nothing, e.g. padded rows only)."""
    box = Box.full(spec.shape)
    if spec.tp_dim is None or tp == 1:
        return box
    d = spec.tp_dim
    if spec.fused and spec.fused[0] == "qkv" and spec.fused[1] > 0:
        # k / v: whole query groups per rank; an engine with tp > groups repeats them.
        head_dim = spec.shape[0] // spec.num_groups
        if tp <= spec.num_groups:
            g0, g1 = _split(spec.num_groups, tp, r)
        else:
            if megatron:
                raise ValueError(f"{spec.name}: Megatron needs num_query_groups ({spec.num_groups}) "
                                 f"divisible by TP ({tp})")
            g0 = r * spec.num_groups // tp
            g1 = g0 + 1
        return box.replace(0, g0 * head_dim, g1 * head_dim)
    n = spec.shape[d]
    if d == 0 and spec.padded_rows:  # vocabulary rows
        n = spec.padded_rows if megatron else -(-n // vocab_padding) * vocab_padding
    a, b = _split(n, tp, r)
    b = min(b, spec.shape[d])
    return box.replace(d, a, b) if a < b else None


def _local_tensors(specs: list[TensorSpec], boxes: dict[str, Box], *, megatron: bool) -> dict[str, LocalTensor]:
    """Group this rank's boxes into its local tensors (fused ones stacked in order)."""
    groups: dict[str, list[TensorSpec]] = {}
    for s in specs:
        if s.name in boxes:
            groups.setdefault(s.megatron_name if megatron else s.engine_name, []).append(s)
    out = {}
    for local, members in groups.items():
        members.sort(key=lambda s: s.fused[1] if s.fused else 0)
        segs: list[tuple[str, Box]] = []
        if megatron and members[0].fused and members[0].fused[0] == "qkv" and len(members) == 3:
            q, k, v = members
            head_dim = k.shape[0] // k.num_groups
            per_group = q.num_heads // q.num_groups
            g0, g1 = boxes[k.name].ranges[0][0] // head_dim, boxes[k.name].ranges[0][1] // head_dim
            for g in range(g0, g1):  # Megatron interleaves [q heads of g; k_g; v_g]
                qb = boxes[q.name].replace(0, g * per_group * head_dim, (g + 1) * per_group * head_dim)
                segs += [(q.name, qb), (k.name, boxes[k.name].replace(0, g * head_dim, (g + 1) * head_dim)),
                         (v.name, boxes[v.name].replace(0, g * head_dim, (g + 1) * head_dim))]
        else:
            segs = [(s.name, boxes[s.name]) for s in members]
        row, placed = 0, []
        for name, box in segs:
            placed.append(Segment(name, box, row))
            row += box.shape[0]
        trailing = {box.shape[1:] for _, box in segs}
        if len(trailing) != 1:
            raise ValueError(f"{local}: fused parts differ beyond dim 0: {sorted(trailing)}")
        out[local] = LocalTensor(local, members[0].dtype, (row, *trailing.pop()), tuple(placed))
    return out


def megatron_layout(specs: list[TensorSpec], *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
                    etp: int | None = None, ranks: Sequence[int] | None = None,
                    layer_stage: Sequence[int] | None = None) -> Layout:
    """The trainer's layout: dense tensors TP-sharded, replicated over DP;
    inside each stage experts split over EP, each expert sharded over ``etp``
    expert-TP ranks (``linear_fc1`` rows, ``[gate_r; up_r]`` per shard;
    ``linear_fc2`` columns) and replicated over the stage's
    ``tp * dp / (ep * etp)`` expert-DP ranks. ``etp`` defaults to ``tp``, as
    Megatron's ``expert_tensor_parallel_size`` does. ``ranks`` default
    ``range(tp*pp*dp)``; ``layer_stage`` defaults to an even split of layers
    over stages."""
    etp = tp if etp is None else etp
    world = tp * pp * dp
    ranks = tuple(range(world)) if ranks is None else tuple(ranks)
    if len(ranks) != world:
        raise ValueError(f"ranks has {len(ranks)} entries, tp*pp*dp is {world}")
    if (tp * dp) % (ep * etp):
        raise ValueError(f"ep={ep} x etp={etp} must divide tp*dp={tp * dp}")
    layer_stage = _layer_stages(specs, pp) if layer_stage is None else list(layer_stage)
    num_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=0)
    if num_experts % ep:
        raise ValueError(f"ep={ep} must divide the number of experts ({num_experts})")
    tensors = {}
    for i, g in enumerate(ranks):
        tp_r, pp_r = i % tp, i // (tp * dp)
        ep_r, etp_r = megatron_expert_coords(i, tp=tp, dp=dp, ep=ep, etp=etp)
        boxes, mine = {}, []
        for s in specs:
            if _stage_of(s, layer_stage, pp) != pp_r:
                continue
            if s.expert is not None:
                if s.expert * ep // num_experts == ep_r:
                    b = _tp_box(s, etp, etp_r, megatron=True)
                    if b is None or (s.tp_dim is not None and s.shape[s.tp_dim] % etp):
                        raise ValueError(f"{s.name}: dim {s.tp_dim} ({s.shape[s.tp_dim]}) is not divisible "
                                         f"by expert TP {etp}")
                    boxes[s.name] = b
                    mine.append(_local_expert(s, s.expert - ep_r * (num_experts // ep)))
                continue
            b = _tp_box(s, tp, tp_r, megatron=True)
            if b is not None:
                boxes[s.name] = b
                mine.append(s)
        tensors[g] = _local_tensors(mine, boxes, megatron=True)
    moe = any(s.expert is not None for s in specs)
    return Layout(ranks, tensors, {s.name: s for s in specs}, f"megatron TP{tp}xPP{pp}xDP{dp}"
                  + (f" EP{ep}" if ep > 1 else "") + (f" ETP{etp}" if etp > 1 and moe else ""))


def megatron_expert_coords(i: int, *, tp: int, dp: int, ep: int, etp: int) -> tuple[int, int]:
    """``(ep_rank, etp_rank)`` of the ``i``-th rank of a Megatron job (``tp * dp``
    ranks per stage). Megatron's expert ranks are ordered ``tp-ep-dp-pp`` with
    expert TP fastest (``parallel_state.initialize_model_parallel``: the expert
    ``RankGenerator(tp=etp, ep=ep, dp=tp*dp/(ep*etp), pp=pp)``, order
    ``tp-cp-ep-dp-pp`` with cp 1), so inside a stage rank ``j`` is expert-TP rank
    ``j % etp`` of EP rank ``j // etp % ep``."""
    j = i % (tp * dp)
    return (j // etp) % ep, j % etp


def ntp_megatron_layout(specs: list[TensorSpec], ntp_layout) -> Layout:
    """The trainer's layout under nonuniform TP (``megatron_ext.nonuniform_tp``):
    each data-parallel replica holds the whole model at its own TP degree
    (``tp_base`` when healthy, ``tp_reduced`` when degraded) on its active ranks.

    ``ntp_layout`` is the job's ``NTPLayout`` (``NTPLayout.from_config(ntp_config,
    world_size)`` or ``get_ntp_process_groups().layout``). On a healthy replica the
    local tensors are the ``tp_base`` *compute* parameters
    (``NonuniformTPDistributedDataParallel.compute_module``), not the training
    shadow that ``ddp.module`` holds: give the executor
    :func:`~.reshard.ntp_megatron_tensors` and ``refresh=ddp.refresh_compute_params``."""
    ranks, tensors = [], {}
    for d in range(ntp_layout.num_replicas):
        group = ntp_layout.tp_group_ranks(d)
        rep = megatron_layout(specs, tp=len(group), ranks=group)
        ranks += group
        tensors.update(rep.tensors)
    return Layout(tuple(ranks), tensors, {s.name: s for s in specs},
                  f"megatron NTP tp_base={ntp_layout.tp_base} tp_reduced={ntp_layout.tp_reduced} "
                  f"x{ntp_layout.num_replicas} replicas")


def _local_expert(spec: TensorSpec, local: int) -> TensorSpec:
    """``spec`` under Megatron's name on its EP rank: the expert's index within
    the rank (``local_experts.{j}.`` in SequentialMLP, ``weight{j}`` in TEGroupedMLP)."""
    name = spec.megatron_name.replace(f"local_experts.{spec.expert}.", f"local_experts.{local}.")
    name = re.sub(rf"(\.experts\.linear_fc[12]\.weight){spec.expert}$", rf"\g<1>{local}", name)
    return dataclasses.replace(spec, megatron_name=name)


def inference_layout(specs: list[TensorSpec], *, tp: int = 1, dp: int = 1, ep: int = 1,
                     ranks: Sequence[int] | None = None, vocab_padding: int = 64) -> Layout:
    """An engine's layout: ``dp`` replicas of ``tp`` ranks (rank order ``tp-dp``),
    QKV and gate/up fused per TP rank. With ``ep > 1`` experts are split over
    ``ep`` consecutive ranks (whole experts, no expert TP); otherwise expert
    tensors are TP-sharded like dense ones. The vocabulary is padded to a
    multiple of ``vocab_padding`` rows before it is split (vLLM pads to 64)."""
    world = tp * dp
    ranks = tuple(range(world)) if ranks is None else tuple(ranks)
    if len(ranks) != world:
        raise ValueError(f"ranks has {len(ranks)} entries, tp*dp is {world}")
    if world % ep:
        raise ValueError(f"ep={ep} must divide tp*dp={world}")
    num_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=0)
    tensors = {}
    for i, g in enumerate(ranks):
        tp_r = i % tp
        boxes = {}
        for s in specs:
            if s.expert is not None and ep > 1:
                if s.expert * ep // num_experts == i % ep:
                    boxes[s.name] = Box.full(s.shape)
                continue
            b = _tp_box(s, tp, tp_r, megatron=False, vocab_padding=vocab_padding)
            if b is not None:
                boxes[s.name] = b
        tensors[g] = _local_tensors(specs, boxes, megatron=False)
    return Layout(ranks, tensors, {s.name: s for s in specs}, f"engine TP{tp}xDP{dp}" + (f" EP{ep}" if ep > 1 else ""))


def _layer_stages(specs: list[TensorSpec], pp: int) -> list[int]:
    n = 1 + max((s.layer for s in specs if s.layer is not None), default=-1)
    if n and n < pp:
        raise ValueError(f"{n} layers cannot fill pp={pp} stages")
    return [layer * pp // n for layer in range(n)]


def gpt_specs(*, num_layers: int, hidden_size: int, num_heads: int, num_groups: int, head_dim: int,
              ffn_hidden_size: int, vocab_size: int, padded_vocab_size: int | None = None,
              tie_embeddings: bool = False, qkv_bias: bool = False, qk_norm: bool = False,
              num_experts: int = 0, moe_ffn_hidden_size: int = 0, dtype: torch.dtype = torch.bfloat16,
              te_layernorm: bool = False, grouped_gemm: bool = False) -> list[TensorSpec]:
    """The HF tensors of a Llama / Qwen2 / Qwen3 (MoE: Qwen3-MoE) model with
    their Megatron and engine (vLLM-style fused) local names.

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
    specs: list[TensorSpec] = []
    pv = padded_vocab_size if padded_vocab_size and padded_vocab_size != vocab_size else None

    def add(name, shape, tp_dim, mname, ename, **kw):
        specs.append(TensorSpec(name, tuple(shape), dtype, tp_dim, mname, ename, **kw))

    add("model.embed_tokens.weight", (vocab_size, hidden_size), 0, "embedding.word_embeddings.weight",
        "model.embed_tokens.weight", padded_rows=pv)
    for i in range(num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        add(h + "input_layernorm.weight", (hidden_size,), None,
            m + ("self_attention.linear_qkv.layer_norm_weight" if te_layernorm else "input_layernorm.weight"),
            h + "input_layernorm.weight", layer=i)
        for suffix in ("weight", "bias") if qkv_bias else ("weight",):
            rest = (hidden_size,) if suffix == "weight" else ()
            for part, (p, rows) in enumerate((("q", num_heads), ("k", num_groups), ("v", num_groups))):
                add(h + f"self_attn.{p}_proj.{suffix}", (rows * head_dim, *rest), 0,
                    m + f"self_attention.linear_qkv.{suffix}", h + f"self_attn.qkv_proj.{suffix}", layer=i,
                    fused=("qkv", part), num_heads=num_heads, num_groups=num_groups)
        if qk_norm:
            for p in ("q", "k"):
                add(h + f"self_attn.{p}_norm.weight", (head_dim,), None, m + f"self_attention.{p}_layernorm.weight",
                    h + f"self_attn.{p}_norm.weight", layer=i)
        add(h + "self_attn.o_proj.weight", (hidden_size, num_heads * head_dim), 1,
            m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight", layer=i)
        fused_norm = te_layernorm and not num_experts  # MoE: TE keeps a separate pre_mlp_layernorm
        add(h + "post_attention_layernorm.weight", (hidden_size,), None,
            m + ("mlp.linear_fc1.layer_norm_weight" if fused_norm else "pre_mlp_layernorm.weight"),
            h + "post_attention_layernorm.weight", layer=i)
        if num_experts:
            add(h + "mlp.gate.weight", (num_experts, hidden_size), None, m + "mlp.router.weight",
                h + "mlp.gate.weight", layer=i)
            for e in range(num_experts):
                he = h + f"mlp.experts.{e}."
                if grouped_gemm:
                    fc1, fc2 = m + f"mlp.experts.linear_fc1.weight{e}", m + f"mlp.experts.linear_fc2.weight{e}"
                else:
                    fc1, fc2 = (m + f"mlp.experts.local_experts.{e}.linear_fc{k}.weight" for k in (1, 2))
                for part, p in enumerate(("gate", "up")):
                    add(he + f"{p}_proj.weight", (moe_ffn_hidden_size, hidden_size), 0, fc1,
                        he + "gate_up_proj.weight", layer=i, expert=e, fused=("glu", part))
                add(he + "down_proj.weight", (hidden_size, moe_ffn_hidden_size), 1, fc2,
                    he + "down_proj.weight", layer=i, expert=e)
        else:
            for part, p in enumerate(("gate", "up")):
                add(h + f"mlp.{p}_proj.weight", (ffn_hidden_size, hidden_size), 0, m + "mlp.linear_fc1.weight",
                    h + "mlp.gate_up_proj.weight", layer=i, fused=("glu", part))
            add(h + "mlp.down_proj.weight", (hidden_size, ffn_hidden_size), 1, m + "mlp.linear_fc2.weight",
                h + "mlp.down_proj.weight", layer=i)
    add("model.norm.weight", (hidden_size,), None, "decoder.final_layernorm.weight", "model.norm.weight")
    if not tie_embeddings:
        add("lm_head.weight", (vocab_size, hidden_size), 0, "output_layer.weight", "lm_head.weight",
            padded_rows=pv)
    return specs


def specs_from_config(config, *, vocab_size: int, padded_vocab_size: int | None = None,
                      tie_embeddings: bool = False, dtype: torch.dtype | None = None,
                      te_layernorm: bool = False, grouped_gemm: bool = False) -> list[TensorSpec]:
    """:func:`gpt_specs` for a Megatron ``TransformerConfig`` (dense or MoE);
    ``te_layernorm=True`` for models built with Transformer Engine layer specs,
    ``grouped_gemm=True`` for TEGroupedMLP experts (TE specs with
    ``moe_grouped_gemm=True``; the local spec builds SequentialMLP either way)."""
    if grouped_gemm and config.num_moe_experts:
        issue = grouped_expert_issue(config)
        if issue is not None:  # the per-expert [gate; up] row ranges would be wrong
            raise ValueError(f"grouped-GEMM experts cannot be described: {issue}")
    heads = config.num_attention_heads
    return gpt_specs(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_heads=heads,
        num_groups=config.num_query_groups or heads, head_dim=config.kv_channels or config.hidden_size // heads,
        ffn_hidden_size=config.ffn_hidden_size, vocab_size=vocab_size, padded_vocab_size=padded_vocab_size,
        tie_embeddings=tie_embeddings, qkv_bias=bool(config.add_qkv_bias), qk_norm=bool(config.qk_layernorm),
        num_experts=config.num_moe_experts or 0, moe_ffn_hidden_size=config.moe_ffn_hidden_size or 0,
        dtype=dtype or config.params_dtype, te_layernorm=te_layernorm, grouped_gemm=grouped_gemm)


_LOCAL_EXPERT = re.compile(r"local_experts\.\d+\.")          # SequentialMLP: local_experts.{j}.linear_fc1.weight
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
    Raises ``ValueError`` naming the first parameter the specs do not describe
    (e.g. legacy GroupedMLP's ``experts.weight1``), so a layout never silently
    skips a tensor.
    """
    m = unwrap(model)
    params = dict(m.named_parameters())
    prefixes = _global_layer_names(m)

    def global_name(name):
        return next((gp + name[len(lp):] for lp, gp in prefixes.items() if name.startswith(lp)), name)

    te = any(n.endswith("linear_qkv.layer_norm_weight") for n in params)
    grouped = any(_GROUPED_EXPERT.search(n) for n in params)
    specs = specs_from_config(
        m.config, vocab_size=vocab_size, padded_vocab_size=getattr(m, "vocab_size", None),
        tie_embeddings=bool(getattr(m, "share_embeddings_and_output_weights", False)),
        dtype=dtype or next(iter(params.values())).dtype, te_layernorm=te, grouped_gemm=grouped)
    known = {_expert_pattern(s.megatron_name) for s in specs}
    if not any(s.name == "lm_head.weight" for s in specs):
        known.add("output_layer.weight")  # tied (a later stage's copy): the engine ties lm_head to the embedding
    for name in params:
        glob = global_name(name)
        if _expert_pattern(glob) not in known:
            # the export hook's hints for parameters it recognises but cannot map (legacy GroupedMLP, TE's
            # single grouped weight, shared experts, expert biases, ...)
            why = next((why for pattern, why in UNSUPPORTED_HINTS if pattern.search(glob)), None)
            raise ValueError(f"parameter {glob!r}: {why}" if why else
                             f"parameter {glob!r} is not in the layout specs (supported: Llama / Qwen2 / Qwen3 "
                             "dense and MoE with local, sequential or TE grouped-GEMM experts, local or TE "
                             "layer specs)")
    return specs
