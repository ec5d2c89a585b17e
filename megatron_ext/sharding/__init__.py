"""Megatron sharding facts, with no communication: how each tensor is split over
TP / EP / PP, the one Megatron -> Hugging Face name table, and where every HF
tensor lives on a trainer's or an engine's ranks. Nonuniform TP's fold/unfold and
checkpoint converters, the export hook and the reshard refit all read them here.

- :mod:`.names`: the name table (per-layer, expert and whole-model entries).
- :mod:`.moe`: the MoE names and the hints for expert layouts that have no HF form.
- :mod:`.spec`: :class:`TensorSpec` and the specs of a model (from a config or a built model).
- :mod:`.geometry`: boxes, TP boxes, fused stacking and :class:`Layout`.
- :mod:`.megatron`: a Megatron parameter's :class:`ShardSpec` and a Megatron job's layout.
- :mod:`.mesh`: :class:`MegatronMesh`, this process's sizes, ranks and groups read from ``parallel_state``.
- :mod:`.fp8`: block-scaled FP8 as a layout (which weights, where their scales live).
- :mod:`.hf_config`: the ``transformers`` config with a Megatron config's shape.
- :mod:`.local_spec`: the ``TransformerConfig`` flags of the local layer spec without fused kernels.
"""

from .fp8 import FP8_BLOCK, fp8_layout
from .geometry import Box, Layout, LocalTensor, Segment, whole_layout
from .hf_config import hf_config_from_megatron
from .local_spec import UNFUSED_LOCAL_SPEC
from .megatron import (
    ShardSpec,
    layout_from_recipe,
    megatron_expert_coords,
    megatron_layout,
    megatron_tensors,
    ntp_megatron_layout,
    shard_spec,
)
from .mesh import MegatronMesh, megatron_layout_from_groups
from .spec import TensorSpec, UnsupportedParameter, gpt_specs, specs_from_config, specs_from_model

__all__ = [
    "FP8_BLOCK",
    "UNFUSED_LOCAL_SPEC",
    "Box",
    "Layout",
    "LocalTensor",
    "MegatronMesh",
    "Segment",
    "ShardSpec",
    "TensorSpec",
    "UnsupportedParameter",
    "fp8_layout",
    "gpt_specs",
    "hf_config_from_megatron",
    "layout_from_recipe",
    "megatron_expert_coords",
    "megatron_layout",
    "megatron_layout_from_groups",
    "megatron_tensors",
    "ntp_megatron_layout",
    "shard_spec",
    "specs_from_config",
    "specs_from_model",
    "whole_layout",
]
