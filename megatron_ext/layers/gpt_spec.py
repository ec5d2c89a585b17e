"""megatron-core's local GPT layer spec with :class:`~megatron_ext.layers.norm.LocalNorm` for every norm.

Megatron's local spec builds its norms with ``WrappedTorchNorm`` (or Apex's ``FusedLayerNorm`` where
Apex is installed), and ``TransformerBlock`` adds its final norm the same way when handed a layer
spec. :func:`local_gpt_block_spec` hands ``GPTModel`` a whole block instead, its layers' norms (input,
pre-MLP, q/k with ``qk_layernorm``) and its final norm all :class:`LocalNorm`: torch's LayerNorm /
RMSNorm with the parameter marks sequence parallelism needs. The same module classes and parameter
names as Megatron's local spec without Apex, so models, checkpoints and name tables are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

from .norm import LocalNorm

__all__ = ["local_gpt_block_spec", "with_local_norms"]


def _replaced_norms() -> tuple[type, ...]:
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return (WrappedTorchNorm, FusedLayerNorm)


def with_local_norms(spec):
    """``spec`` (a ``ModuleSpec``, a ``TransformerBlockSubmodules``, any submodules dataclass, a
    ``functools.partial`` of a module, or a list of these) with every ``WrappedTorchNorm`` and
    ``FusedLayerNorm`` in it replaced by :class:`LocalNorm`. Copies; ``spec`` is left as it was."""
    return _replace(spec, _replaced_norms())


def _replace(obj, norms):
    if isinstance(obj, type):
        return LocalNorm if obj in norms else obj
    if isinstance(obj, functools.partial):
        return functools.partial(
            _replace(obj.func, norms),
            *(_replace(a, norms) for a in obj.args),
            **{k: _replace(v, norms) for k, v in obj.keywords.items()},
        )
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(x, norms) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _replace(getattr(obj, f.name), norms) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def local_gpt_block_spec(config, layer_spec=None, *, vp_stage: int | None = None, pp_rank: int | None = None):
    """The ``TransformerBlockSubmodules`` of a GPT decoder on megatron-core's local spec, every norm
    :class:`LocalNorm` (pass it to ``GPTModel(transformer_layer_spec=...)``).

    ``layer_spec=None``: Megatron's own block of ``config`` (``get_gpt_decoder_block_spec`` with
    ``use_transformer_engine=False``: dense and MoE layers by ``moe_layer_freq``, ``qk_layernorm``,
    this pipeline stage's layers). A layer ``ModuleSpec`` (e.g. ``get_gpt_layer_local_spec(...)``,
    changed by the caller) is repeated for this stage's layers (``get_num_layers_to_build``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if layer_spec is None:
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        block = TransformerBlockSubmodules(layer_specs=[layer_spec] * count, layer_norm=LocalNorm)
    return with_local_norms(block)
