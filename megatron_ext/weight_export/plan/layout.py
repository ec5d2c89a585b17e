"""Inference engines' layouts: where each HF tensor lives on an engine's ranks.

The trainer's side (:func:`megatron_ext.sharding.megatron_layout`) and the
engine's share one description of TP boxes and fused stacking
(:mod:`megatron_ext.sharding.geometry`); the planner (:mod:`.reshard_plan`)
intersects them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...nogc import paused_gc
from ...sharding.geometry import Box, Layout, local_tensors, tp_box
from ...sharding.spec import TensorSpec

__all__ = ["inference_layout"]


@paused_gc()  # tens of thousands of boxes and segments at scale (see megatron_ext/nogc.py)
def inference_layout(
    specs: list[TensorSpec],
    *,
    tp: int = 1,
    dp: int = 1,
    ep: int = 1,
    ranks: Sequence[int] | None = None,
    vocab_padding: int = 64,
) -> Layout:
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
    tensors, built = {}, {}  # replicas share one dict of local tensors: cut once (and the planner's work once)
    for i, g in enumerate(ranks):
        tp_r = i % tp
        if (tp_r, i % ep) in built:
            tensors[g] = built[tp_r, i % ep]
            continue
        boxes = {}
        for s in specs:
            if s.expert is not None and ep > 1:
                if s.expert * ep // num_experts == i % ep:
                    boxes[s.name] = Box.full(s.shape)
                continue
            b = tp_box(s, tp, tp_r, megatron=False, vocab_padding=vocab_padding)
            if b is not None:
                boxes[s.name] = b
        tensors[g] = built[tp_r, i % ep] = local_tensors(specs, boxes, megatron=False)
    return Layout(ranks, tensors, {s.name: s for s in specs}, f"engine TP{tp}xDP{dp}" + (f" EP{ep}" if ep > 1 else ""))
