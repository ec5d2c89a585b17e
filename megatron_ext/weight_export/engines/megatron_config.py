"""The trainer's model config as a megatron-core engine builds it: plain JSON (format
:data:`MODEL_CONFIG_FORMAT`, nothing pickled), published through the refit group's store.

Trainer side, every rank (:func:`~..megatron_refit.megatron_trainer_refit` does it)::

    published = megatron_model_config(model)   # {"format": 3, "model": "GPTModel", "config": {...}}
    publish_model_config(group, published)     # refit rank 0 sets it; or error=exc: why nothing comes

Engine side, every rank::

    published = receive_model_config(group)
    problem = megatron_model_problem(published, tp=E_TP, ep=E_EP)   # None, or the field it cannot build
    model = build_engine_model(published, device=device)   # megatron-core's local layer spec; weights NaN

:data:`MODEL_FIELDS` are the fields the engine builds (and the values it builds of each);
:data:`MOE_FIELDS` those of an MoE model (``num_moe_experts`` set: the layers ``moe_layer_freq`` marks 1
MoE layers of ``SequentialMLP`` experts, routed as the trainer routes, those it marks 0 dense MLPs of
``ffn_hidden_size``, as megatron-core builds them); :data:`DEFAULT_ONLY_FIELDS` are published
so that the engine refuses a model that sets them. Fields that only shape training (aux-loss and
z-loss coefficients, ``moe_input_jitter_eps``, recomputation, fusions, the expert-parallel sizes)
are not published: the engine routes without jitter and picks its own parallel sizes.

The engine's expert parallelism (:func:`engine_expert_tp`): experts split over ``ep`` engine ranks,
each expert whole on its EP rank (expert TP 1) when ``ep > 1``, or TP-sharded like the dense MLP
(expert TP = the engine's TP, megatron-core's default) when ``ep == 1``.

Format 2 added the MoE fields and the engine's ``ep`` / ``etp``; format 3 added ``moe_layer_freq`` (one
0 or 1 per layer: models that mix dense and MoE layers). An engine reads formats 1 (a dense model: the
MoE fields take their defaults), 2 (an MoE model: every layer an MoE layer) and 3.
"""

from __future__ import annotations

import json
import math

import torch

from ...sharding.local_spec import UNFUSED_LOCAL_SPEC
from ...sharding.moe import TOPK_BALANCING as _ROUTING
from ...sharding.moe import moe_layer_pattern
from ...sharding.names import unwrap
from ..control.refit_group import RefitGroup

__all__ = [
    "DEFAULT_ONLY_FIELDS",
    "MODEL_CONFIG_FORMAT",
    "MODEL_FIELDS",
    "MOE_FIELDS",
    "build_engine_model",
    "engine_expert_tp",
    "megatron_model_config",
    "megatron_model_problem",
    "publish_model_config",
    "receive_model_config",
]

MODEL_CONFIG_FORMAT = 3
"""The format of :func:`megatron_model_config`; an engine refuses a newer one, naming both. Format 2
added the MoE fields (:data:`MOE_FIELDS`, MoE entries of :data:`DEFAULT_ONLY_FIELDS`), format 3
``moe_layer_freq``."""

_MODEL_TAG = "megatron-model"  # store key prefix (RefitGroup.next_tag) of the published model config
_NOTE = 1000  # the longest error text the trainer publishes
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# activation_func by name: torch.nn.functional's and megatron.core.activations' (resolved when building)
_ACTIVATIONS = ("silu", "gelu", "relu", "squared_relu", "quick_gelu", "fast_gelu")
_INT, _BOOL, _NUMBER = "an integer >= 1", "true or false", "a finite number"
# What the engine builds its GPTModel from: field -> the values it builds (a tuple of choices, or a kind).
MODEL_FIELDS = {
    "transformer_impl": ("local",),  # the layer spec; Transformer Engine's layers are not built by the engine
    "num_layers": _INT,
    "hidden_size": _INT,
    "num_attention_heads": _INT,
    "num_query_groups": _INT,
    "kv_channels": _INT,
    "ffn_hidden_size": _INT,
    "normalization": ("LayerNorm", "RMSNorm"),
    "layernorm_epsilon": _NUMBER,
    "layernorm_zero_centered_gamma": _BOOL,
    "gated_linear_unit": _BOOL,
    "activation_func": _ACTIVATIONS,
    "add_bias_linear": _BOOL,
    "add_qkv_bias": _BOOL,
    "qk_layernorm": _BOOL,
    "apply_residual_connection_post_layernorm": _BOOL,
    "fp32_residual_connection": _BOOL,
    "attention_softmax_in_fp32": _BOOL,
    "apply_query_key_layer_scaling": _BOOL,
    "softmax_scale": "null or a finite number",
    "params_dtype": tuple(_DTYPES),
    "padded_vocab_size": _INT,
    "max_sequence_length": _INT,
    "share_embeddings_and_output_weights": _BOOL,
    "position_embedding_type": ("rope", "none"),
    "rotary_percent": _NUMBER,
    "rotary_base": _NUMBER,
    "rotary_interleaved": _BOOL,
    "rope_scaling": _BOOL,
    "seq_len_interpolation_factor": "null or a finite number",
    "rotary_inv_freq": "null or a list of finite numbers",
    "num_moe_experts": "null or an integer >= 1",  # null: dense; else MoE layers by moe_layer_freq (:data:`MOE_FIELDS`)
}
# _ROUTING: the balancing kinds that route alike at inference (plain top-k), sharding.moe.TOPK_BALANCING
_ROUTING_KIND = f"one of {list(_ROUTING)} or a list of them"
_PATTERN = "null (every layer an MoE layer) or a list of num_layers entries, each 0 (dense MLP) or 1 (MoE)"
# What the engine builds an MoE layer from (checked when num_moe_experts is set; published for every model).
MOE_FIELDS = {
    "moe_ffn_hidden_size": _INT,
    "moe_router_topk": _INT,
    "moe_router_pre_softmax": _BOOL,
    "moe_router_score_function": ("softmax",),
    "moe_router_dtype": (None, "fp32", "fp64"),
    "moe_router_load_balancing_type": _ROUTING_KIND,
    "moe_grouped_gemm": (False,),
    "moe_token_dispatcher_type": ("allgather", "alltoall"),
    "moe_layer_freq": _PATTERN,  # format 3; the trainer publishes its moe_layer_pattern (a list) for an MoE model
}
# Why a value is not built, where the allowed values alone do not say it.
_WHY = {
    "moe_grouped_gemm": "megatron-core's local layer spec runs SequentialMLP experts; grouped GEMM experts "
    "(TEGroupedMLP) need Transformer Engine",
    "moe_token_dispatcher_type": "the flex dispatcher needs DeepEP / HybridEP",
    "moe_router_score_function": "the refit's name table maps softmax top-k routers",
    "moe_router_load_balancing_type": "sinkhorn and quantile balancing route otherwise at inference, the "
    "latter by a bias buffer the refit does not send",
    "moe_router_enable_expert_bias": "the router's expert_bias is a buffer: the refit sends parameters",
    "moe_expert_capacity_factor": "the engine builds dropless MoE layers: which tokens a capacity drops "
    "depends on the batch",
}
# TransformerConfig fields the engine does not build: published so that it refuses a model that sets them.
DEFAULT_ONLY_FIELDS = {
    "moe_shared_expert_intermediate_size": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_apply_probs_on_input": False,
    "moe_latent_size": None,
    "moe_expert_capacity_factor": None,
    "moe_router_force_load_balancing": False,
    "moe_router_force_biased": None,
    "moe_enable_routing_replay": False,
    "multi_latent_attention": False,
    "mtp_num_layers": None,
    "window_size": None,
    "attention_output_gate": False,
    "experimental_attention_variant": None,
    "heterogeneous_block_specs": False,
    "is_hybrid_model": False,
    "qk_l2_norm": False,
    "use_mup": False,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
    "no_rope_freq": None,
}


def _json_value(value):
    """A config value as JSON can carry it (tuples as lists; anything else not plain by its repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return repr(value)


def _activation_name(fn) -> str:
    import torch.nn.functional as F
    from megatron.core import activations

    for name in _ACTIVATIONS:
        if fn is getattr(F, name, None) or fn is getattr(activations, name, None):
            return name
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def megatron_model_config(model) -> dict:
    """What a megatron-core engine needs to build ``model``'s architecture (a ``GPTModel``, possibly
    inside DDP / ``Float16Module``), as plain JSON: ``{"format": MODEL_CONFIG_FORMAT, "model":
    "GPTModel", "config": {field: value}}`` with the fields of :data:`MODEL_FIELDS` and
    :data:`DEFAULT_ONLY_FIELDS`. Parallel sizes, initialisation and training settings are left out:
    the engine picks its own TP, and takes the weights from the refit."""
    gpt = unwrap(model)
    config = gpt.config
    te = any(type(m).__module__.startswith(("megatron.core.extensions", "transformer_engine")) for m in gpt.modules())
    rotary = getattr(gpt, "rotary_pos_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    fields = {
        "transformer_impl": "transformer_engine" if te else "local",
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups or config.num_attention_heads,
        "kv_channels": config.kv_channels,
        "ffn_hidden_size": config.ffn_hidden_size,
        "normalization": config.normalization,
        "layernorm_epsilon": config.layernorm_epsilon,
        "layernorm_zero_centered_gamma": config.layernorm_zero_centered_gamma,
        "gated_linear_unit": config.gated_linear_unit,
        "activation_func": _activation_name(config.activation_func),
        "add_bias_linear": config.add_bias_linear,
        "add_qkv_bias": config.add_qkv_bias,
        "qk_layernorm": config.qk_layernorm,
        "apply_residual_connection_post_layernorm": config.apply_residual_connection_post_layernorm,
        "fp32_residual_connection": config.fp32_residual_connection,
        "attention_softmax_in_fp32": config.attention_softmax_in_fp32,
        "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
        "softmax_scale": config.softmax_scale,
        "params_dtype": str(config.params_dtype).removeprefix("torch."),
        "padded_vocab_size": gpt.vocab_size,
        "max_sequence_length": gpt.max_sequence_length,
        "share_embeddings_and_output_weights": gpt.share_embeddings_and_output_weights,
        "position_embedding_type": gpt.position_embedding_type,
        "rotary_percent": getattr(gpt, "rotary_percent", 1.0),
        "rotary_base": getattr(gpt, "rotary_base", 10000),
        "rotary_interleaved": config.rotary_interleaved,
        "rope_scaling": bool(getattr(gpt, "rotary_scaling", False)),
        "seq_len_interpolation_factor": getattr(rotary, "seq_len_interpolation_factor", None),
        # the frequencies themselves: rope_scaling's factor is not kept by GPTModel; the engine checks its own
        "rotary_inv_freq": None if inv_freq is None else [float(f) for f in inv_freq.float().cpu()],
        "num_moe_experts": config.num_moe_experts,
        # megatron-core's MoE layers run moe_ffn_hidden_size, ffn_hidden_size when it is None
        "moe_ffn_hidden_size": config.moe_ffn_hidden_size or config.ffn_hidden_size,
        "moe_router_topk": config.moe_router_topk,
        "moe_router_pre_softmax": config.moe_router_pre_softmax,
        "moe_router_score_function": config.moe_router_score_function,
        "moe_router_dtype": config.moe_router_dtype,
        "moe_router_load_balancing_type": config.moe_router_load_balancing_type,
        "moe_grouped_gemm": bool(config.moe_grouped_gemm),
        "moe_token_dispatcher_type": config.moe_token_dispatcher_type,
        # one 0 (dense MLP) or 1 (MoE layer) per layer, from Megatron's int or list moe_layer_freq
        "moe_layer_freq": [int(moe) for moe in moe_layer_pattern(config)] if config.num_moe_experts else None,
    }
    for name, default in DEFAULT_ONLY_FIELDS.items():
        fields[name] = _json_value(getattr(config, name, default))
    return {
        "format": MODEL_CONFIG_FORMAT,
        "model": "GPTModel",
        "config": {k: _json_value(v) for k, v in fields.items()},
    }


def _field_problem(name: str, value, allowed) -> str | None:
    if isinstance(allowed, tuple):
        # exact types: JSON's false is not 0, nor null "none"
        return None if any(type(value) is type(a) and value == a for a in allowed) else f"one of {list(allowed)}"
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    integer = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ok = {
        _INT: integer,
        "null or an integer >= 1": value is None or integer,
        _ROUTING_KIND: value in _ROUTING
        or (isinstance(value, list) and value and all(isinstance(v, str) and v in _ROUTING for v in value)),
        _BOOL: isinstance(value, bool),
        _NUMBER: number,
        "null or a finite number": value is None or number,
        _PATTERN: value is None or (isinstance(value, list) and all(type(v) is int and v in (0, 1) for v in value)),
        "null or a list of finite numbers": value is None
        or (
            isinstance(value, list)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        ),
    }[allowed]
    return None if ok else allowed


def engine_expert_tp(tp: int, ep: int) -> int:
    """The engine's expert tensor parallel size at TP ``tp`` and EP ``ep``: ``tp`` when ``ep == 1``
    (experts TP-sharded like the dense MLP, megatron-core's default), 1 when ``ep > 1`` (whole experts
    per EP rank, as vLLM's expert parallelism places them). The only two the engine runs."""
    return tp if ep == 1 else 1


def _upgraded(config: dict, fmt: int) -> dict:
    """A format-``fmt`` config in this format: format 1 (a dense model) lacks the MoE fields, format 2
    ``moe_layer_freq`` (every layer an MoE layer: null)."""
    if fmt >= 3:
        return config
    if fmt == 2:
        return {"moe_layer_freq": None, **config}
    moe = {"moe_ffn_hidden_size": None, "moe_router_topk": 2, "moe_router_pre_softmax": False,
           "moe_router_score_function": "softmax", "moe_router_dtype": None,
           "moe_router_load_balancing_type": "aux_loss", "moe_grouped_gemm": False,
           "moe_token_dispatcher_type": "allgather"}  # fmt: skip
    return {"num_moe_experts": None, **moe, "moe_layer_freq": None, **DEFAULT_ONLY_FIELDS, **config}


def megatron_model_problem(published, tp: int, ep: int = 1) -> str | None:
    """Why an engine at tensor parallel size ``tp`` and expert parallel size ``ep`` (expert TP
    :func:`engine_expert_tp`) cannot build the model the trainer published
    (:func:`megatron_model_config`), naming the field and what the engine builds; None: it can.
    No Megatron import: the check runs before anything is built."""
    if not isinstance(published, dict) or not isinstance(published.get("format"), int):
        return f"the trainer's published model config is not a megatron_ext model config: {str(published)[:200]}"
    fmt = published["format"]
    if fmt > MODEL_CONFIG_FORMAT or fmt < 1:
        return (
            f"the trainer publishes its model config in format {fmt}; this engine reads format "
            f"{MODEL_CONFIG_FORMAT}: run the same megatron_ext release in the engine as in the trainer"
        )
    if "error" in published:
        return f"the trainer could not build its side of the refit: {published['error']}"
    if published.get("model") != "GPTModel":
        return f"model={published.get('model')!r}: the engine builds megatron-core's GPTModel only"
    config = published.get("config")
    if not isinstance(config, dict):
        return "the trainer's published model config has no 'config' object"
    config = _upgraded(config, fmt)
    unknown = sorted(set(config) - set(MODEL_FIELDS) - set(MOE_FIELDS) - set(DEFAULT_ONLY_FIELDS))
    if unknown:
        return (
            f"the trainer's model config has fields this engine does not know ({', '.join(unknown)}) in format "
            f"{fmt}: run the same megatron_ext release in the engine as in the trainer"
        )
    missing = sorted((set(MODEL_FIELDS) | set(MOE_FIELDS)) - set(config))
    if missing:
        return f"the trainer's model config lacks {', '.join(missing)}: run the same megatron_ext release on both sides"
    moe = config["num_moe_experts"] is not None
    for name, allowed in [*MODEL_FIELDS.items(), *(MOE_FIELDS.items() if moe else ())]:
        want = _field_problem(name, config.get(name), allowed)
        if want is not None:
            why = f" ({_WHY[name]})" if name in _WHY else ""
            return f"{name}={config.get(name)!r}: the engine builds {name} = {want}{why}"
    for name, default in DEFAULT_ONLY_FIELDS.items():
        if config.get(name, default) != default:
            why = f"; {_WHY[name]}" if name in _WHY else ""
            return (
                f"{name}={config[name]!r}: the engine builds GPT models of megatron-core's local layer spec "
                f"without it ({name}={default!r}{why})"
            )
    if config["num_attention_heads"] % config["num_query_groups"]:
        return (
            f"num_query_groups={config['num_query_groups']} does not divide "
            f"num_attention_heads={config['num_attention_heads']}"
        )
    pattern = config["moe_layer_freq"] if moe else None
    if pattern is not None and len(pattern) != config["num_layers"]:
        return (
            f"moe_layer_freq has {len(pattern)} entries: the engine builds moe_layer_freq = a list of "
            f"num_layers={config['num_layers']} entries, each 0 (dense MLP) or 1 (MoE)"
        )
    dense_mlp = not moe or (pattern is not None and 0 in pattern)  # a layer with a dense MLP of ffn_hidden_size
    dense = ("num_attention_heads", "num_query_groups", "padded_vocab_size", *(("ffn_hidden_size",) * dense_mlp))
    for name in dense:
        if config[name] % tp:
            return f"{name}={config[name]} is not divisible by the engine's TP {tp}: pick a TP that divides it"
    if moe:
        experts, etp = config["num_moe_experts"], engine_expert_tp(tp, ep)
        if config["moe_router_topk"] > experts:
            return f"moe_router_topk={config['moe_router_topk']} exceeds num_moe_experts={experts}"
        if experts % ep:
            return f"num_moe_experts={experts} is not divisible by the engine's EP {ep}: pick an EP that divides it"
        if config["moe_ffn_hidden_size"] % etp:
            return (
                f"moe_ffn_hidden_size={config['moe_ffn_hidden_size']} is not divisible by the engine's expert TP "
                f"{etp} (its TP at EP 1): pick a TP that divides it, or EP > 1 (whole experts)"
            )
    if config["position_embedding_type"] == "rope" and config["rotary_inv_freq"] is None:
        return "position_embedding_type='rope' without rotary_inv_freq: run the same megatron_ext release on both sides"
    return None


def publish_model_config(group: RefitGroup, published: dict | None = None, *, error: BaseException | None = None):
    """On every trainer rank, once per refit the trainer builds (the store key is counted per call): refit
    rank 0 publishes ``published`` (:func:`megatron_model_config`, with the engine's ``{"tp", "dp", "ep", "etp"}`` under
    ``"engine"``) or, given ``error``, why the trainer cannot build its side (the engine's
    :func:`megatron_model_problem` quotes it)."""
    key = f"{group.next_tag(_MODEL_TAG)}/config"
    if group.rank != 0:
        return
    if error is not None:
        published = {"format": MODEL_CONFIG_FORMAT, "error": f"{type(error).__name__}: {error}"[:_NOTE]}
    group.store.set(key, json.dumps(published))


def receive_model_config(group: RefitGroup, timeout_s: float | None = None) -> dict:
    """On an engine rank: the model config the trainer published in
    :func:`~..megatron_refit.megatron_trainer_refit` (every engine rank calls it once per trainer refit,
    before building its :class:`~..megatron_refit.MegatronEngineRefit`). Waits up to ``timeout_s``
    (default: the group's)."""
    key = f"{group.next_tag(_MODEL_TAG)}/config"
    group.wait_keys(
        [key],
        [0],
        what="publish its megatron-core model config (a trainer refits a megatron-core engine through "
        "megatron_trainer_refit, e.g. examples/pretrain_gpt.py --refit-engine megatron)",
        timeout_s=timeout_s,
    )
    raw = group.store.get(key).decode(errors="replace")
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {"format": None, "raw": raw[:200]}


def build_engine_model(published: dict, *, device, seed: int = 0):
    """This engine rank's ``GPTModel`` (megatron-core's local layer spec, pipeline size 1) of the
    model the trainer published (:func:`megatron_model_config`; check it first with
    :func:`megatron_model_problem`), at the TP size of the engine job's parallel state (an MoE model:
    also its EP and expert-TP sizes, the layers ``moe_layer_freq`` marks MoE layers of ``SequentialMLP``
    experts, the others dense MLPs: megatron-core's ``get_gpt_decoder_block_spec``); wrapped in
    ``Float16Module`` for a bfloat16 / float16 model, as Megatron-LM serves it. Call after
    ``initialize_model_parallel``. Its weights are NaN until the first refit writes them: a parameter
    that no refit writes shows in the engine's output. Raises ValueError if the rotary frequencies it
    builds are not the trainer's (e.g. rope scaling with another factor)."""
    from megatron.core import activations, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = _upgraded(published["config"], published["format"])
    device = torch.device(device)
    dtype = _DTYPES[c["params_dtype"]]
    act = c["activation_func"]
    activation = getattr(torch.nn.functional, act, None) or getattr(activations, act)
    experts = c["num_moe_experts"]
    moe, mixed = {}, False
    if experts is not None:  # MoE layers of SequentialMLP experts (by moe_layer_freq), routed as the trainer routes
        moe = dict(
            num_moe_experts=experts,
            moe_ffn_hidden_size=c["moe_ffn_hidden_size"],
            moe_router_topk=c["moe_router_topk"],
            moe_router_pre_softmax=c["moe_router_pre_softmax"],
            moe_router_score_function=c["moe_router_score_function"],
            moe_router_dtype=c["moe_router_dtype"],
            moe_router_load_balancing_type="none",  # the aux-loss kinds route alike; no loss at inference
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type=c["moe_token_dispatcher_type"],
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        )
        mixed = 0 in (c["moe_layer_freq"] or ())  # format 3; null (format 2) or all 1: every layer an MoE layer
        if mixed:
            moe["moe_layer_freq"] = list(c["moe_layer_freq"])
    config = TransformerConfig(
        num_layers=c["num_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_query_groups"],
        kv_channels=c["kv_channels"],
        ffn_hidden_size=c["ffn_hidden_size"],
        normalization=c["normalization"],
        layernorm_epsilon=c["layernorm_epsilon"],
        layernorm_zero_centered_gamma=c["layernorm_zero_centered_gamma"],
        gated_linear_unit=c["gated_linear_unit"],
        activation_func=activation,
        add_bias_linear=c["add_bias_linear"],
        add_qkv_bias=c["add_qkv_bias"],
        qk_layernorm=c["qk_layernorm"],
        apply_residual_connection_post_layernorm=c["apply_residual_connection_post_layernorm"],
        fp32_residual_connection=c["fp32_residual_connection"],
        attention_softmax_in_fp32=c["attention_softmax_in_fp32"],
        apply_query_key_layer_scaling=c["apply_query_key_layer_scaling"],
        softmax_scale=c["softmax_scale"],
        rotary_interleaved=c["rotary_interleaved"],
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # the refit writes every weight
        **moe,
        **UNFUSED_LOCAL_SPEC,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # the RNG tracker megatron-core's forward forks
    if mixed:  # dense and MoE layers, as megatron-core builds them
        layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=c["normalization"])
    else:  # every layer alike
        layers = get_gpt_layer_local_spec(
            num_experts=experts,
            moe_grouped_gemm=False,
            qk_layernorm=c["qk_layernorm"],
            normalization=c["normalization"],
        )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layers,
        vocab_size=c["padded_vocab_size"],
        max_sequence_length=c["max_sequence_length"],
        share_embeddings_and_output_weights=c["share_embeddings_and_output_weights"],
        position_embedding_type=c["position_embedding_type"],
        rotary_percent=c["rotary_percent"],
        rotary_base=c["rotary_base"],
        rope_scaling=c["rope_scaling"],
        seq_len_interpolation_factor=c["seq_len_interpolation_factor"],
    ).to(device)
    if c["rotary_inv_freq"] is not None:
        mine = gpt.rotary_pos_emb.inv_freq.float().cpu()
        theirs = torch.tensor(c["rotary_inv_freq"], dtype=torch.float32)
        if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=1e-6, atol=0):
            raise ValueError(
                "rotary_inv_freq: the rotary frequencies the engine builds from rotary_base="
                f"{c['rotary_base']}, rotary_percent={c['rotary_percent']}, rope_scaling={c['rope_scaling']} are not "
                "the trainer's (rope scaling with a factor other than megatron-core's default 8?)"
            )
    with torch.no_grad():
        for p in gpt.parameters():
            p.fill_(float("nan"))
    return Float16Module(config, gpt) if dtype != torch.float32 else gpt
