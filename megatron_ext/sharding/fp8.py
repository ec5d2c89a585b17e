"""Block-scaled FP8 as a layout (no communication): which tensors are quantized and where their scales live.

FP8 checkpoints of DeepSeek-V3 / Qwen3 (and vLLM's block-FP8 loader) store each
linear weight of a decoder layer as ``float8_e4m3fn`` plus ``weight_scale_inv``,
one float32 per ``128 x 128`` block (dequantized weight = fp8 value x the block's
``weight_scale_inv``); embeddings, ``lm_head``, norms and MoE routers stay in the
model's dtype. :func:`fp8_layout` turns a layout into that form: every quantized
local tensor keeps its name, shape and segments with dtype ``float8_e4m3fn``, and
gains a scale tensor (``<local>_scale_inv``) whose segments are the weight's
boxes divided by the block. Applied to both sides of a refit it lets the planner
and the executor move FP8 weights and their scales like any other tensors. Every
box and segment row of a quantized tensor must start on a block boundary (and end
on one, or at the tensor's end), so that each rank's shard covers whole blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from .geometry import Box, Layout, LocalTensor, Segment
from .spec import TensorSpec

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "fp8_layout", "is_quantized", "scale_name", "scale_shape"]

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn


def is_quantized(spec: TensorSpec) -> bool:
    """A 2-D linear weight inside a decoder layer, MoE router excluded (what FP8 checkpoints quantize)."""
    return (
        spec.layer is not None
        and len(spec.shape) == 2
        and spec.name.endswith(".weight")
        and not spec.name.endswith(".mlp.gate.weight")
    )


def scale_name(name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv`` (the checkpoint's name of its block scales)."""
    return name + "_scale_inv"


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def scale_shape(shape, block: int = FP8_BLOCK) -> tuple[int, ...]:
    """The shape of a weight's ``weight_scale_inv``: one scale per ``block x block`` block, a partial last block
    included."""
    return tuple(_blocks(n, block) for n in shape)


def _scale_box(box: Box, spec: TensorSpec, block: int, where: str) -> Box:
    ranges = []
    for d, (a, b) in enumerate(box.ranges):
        if a % block or (b % block and b != spec.shape[d]):
            raise ValueError(
                f"FP8 refit: {where} holds {spec.name}[{a}:{b}] on dim {d}, not whole {block}x{block} blocks; "
                f"block-scaled FP8 needs every shard to start and end on a multiple of {block} (or at the "
                "tensor's end), which the model's shapes and both sides' TP degrees decide; or refit in the "
                "model's dtype (--refit-quantize none)"
            )
        ranges.append((a // block, _blocks(b, block)))
    return Box(tuple(ranges))


def _scale_spec(spec: TensorSpec, block: int) -> TensorSpec:
    return dataclasses.replace(
        spec,
        name=scale_name(spec.name),
        shape=scale_shape(spec.shape, block),
        dtype=torch.float32,
        megatron_name=scale_name(spec.megatron_name),
        engine_name=scale_name(spec.engine_name),
        padded_rows=None,
    )


def fp8_layout(layout: Layout, block: int = FP8_BLOCK) -> Layout:
    """``layout`` with its decoder-layer linear weights in block-scaled FP8 (see the module's doc).

    ``recipe`` stays JSON (``{"kind": "fp8-block", "block": ..., "base": <the layout's recipe>}``), so a
    remote engine rebuilds it; :attr:`~.geometry.Layout.base` is ``layout``. ValueError, naming the
    tensor and the rank, if a quantized tensor's shard does not cover whole blocks."""
    if block <= 0:
        raise ValueError(f"block must be > 0, got {block}")
    specs = dict(layout.specs)
    for s in layout.specs.values():
        if is_quantized(s):
            specs[s.name] = dataclasses.replace(s, dtype=FP8_DTYPE)
            specs[scale_name(s.name)] = _scale_spec(s, block)
    tensors, done = {}, {}  # ranks that share one dict of local tensors (data-parallel replicas) keep sharing it
    for rank, locals_ in layout.tensors.items():
        if id(locals_) in done:
            tensors[rank] = done[id(locals_)]
            continue
        out = done[id(locals_)] = {}
        for name, lt in locals_.items():
            quantized = [is_quantized(layout.specs[seg.name]) for seg in lt.segments]
            if not any(quantized):
                out[name] = lt
                continue
            where = f"rank {rank}'s {name}"
            if not all(quantized):
                raise ValueError(f"FP8 refit: {where} fuses quantized and unquantized tensors")
            segments = []
            for seg in lt.segments:
                if seg.row % block:
                    raise ValueError(
                        f"FP8 refit: {where} stacks {seg.name} at row {seg.row}, not on a {block}-row block; "
                        "refit in the model's dtype (--refit-quantize none)"
                    )
                box = _scale_box(seg.box, layout.specs[seg.name], block, where)
                segments.append(Segment(scale_name(seg.name), box, seg.row // block))
            out[name] = dataclasses.replace(lt, dtype=FP8_DTYPE)
            shape = scale_shape(lt.shape, block)
            out[scale_name(name)] = LocalTensor(scale_name(name), torch.float32, shape, tuple(segments))
        tensors[rank] = out
    recipe = None if layout.recipe is None else {"kind": "fp8-block", "block": block, "base": layout.recipe}
    return Layout(layout.ranks, tensors, specs, f"{layout.description} FP8 block {block}", recipe, base=layout)
