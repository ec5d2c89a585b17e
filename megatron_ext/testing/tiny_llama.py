"""A tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE-shaped megatron-core GPTModel (local spec).

RoPE, RMSNorm, SwiGLU, GQA and no linear bias, so its weights map one to one
onto ``transformers``' Llama/Qwen classes (Qwen2 adds QKV bias, Qwen3
qk-layernorm, Qwen3-MoE experts: ``SequentialMLP``, softmax top-k router, no
aux loss or token dropping; dense and MoE layers mixed by ``moe_layer_freq``, Qwen3-MoE's
``mlp_only_layers``). Like :mod:`tiny_gpt`, weights are drawn on CPU
from the global seed: the same global model at every TP degree. Not across PP
or EP degrees: a later pipeline stage draws its layers from a different point
of the RNG stream (so do layers after experts when EP changes their count), so
such tests need their own reference (gather the ranks' weights). Expert weights
are redrawn from their global expert index, so experts differ across EP ranks.
:func:`as_te_grouped_moe` renames a built MoE model's parameters to Transformer
Engine's (TEGroupedMLP experts), keeping its forward, for export tests on CPU.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class TinyLlamaSpec:
    arch: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 96
    vocab_size: int = 128  # Megatron's (padded) rows
    hf_vocab_size: int = 120  # the HF model's vocabulary (<= vocab_size)
    seq_length: int = 16
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    layernorm_epsilon: float = 1e-6
    seed: int = 1234
    num_moe_experts: int = 4  # qwen3_moe only
    moe_ffn_hidden_size: int = 32
    moe_router_topk: int = 2
    moe_layer_freq: int | tuple[int, ...] = 1  # qwen3_moe only: Megatron's (an int k, or one 0/1 per layer)


def transformer_config(spec: TinyLlamaSpec, tp: int = 1, pp: int = 1, ep: int = 1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.sharding import UNFUSED_LOCAL_SPEC

    if spec.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {spec.arch!r}")
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.hidden_size // spec.num_attention_heads,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=spec.layernorm_epsilon,
        add_bias_linear=False,
        add_qkv_bias=spec.arch == "qwen2",
        qk_layernorm=spec.arch in ("qwen3", "qwen3_moe"),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        **UNFUSED_LOCAL_SPEC,
    )
    if spec.arch == "qwen3_moe":
        kwargs.update(
            num_moe_experts=spec.num_moe_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_router_topk,
            moe_grouped_gemm=False,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            # megatron-core reads a pattern from a list only
            moe_layer_freq=list(spec.moe_layer_freq) if isinstance(spec.moe_layer_freq, tuple) else spec.moe_layer_freq,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(spec: TinyLlamaSpec, config, device: torch.device | str = "cpu"):
    """This rank's GPTModel shard; call after ``initialize_model_parallel``. An MoE ``config`` whose
    ``moe_layer_freq`` leaves some layers dense builds them as megatron-core does (dense MLPs of
    ``ffn_hidden_size``: ``get_gpt_decoder_block_spec``)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from megatron_ext.sharding.moe import moe_layer_pattern

    torch.manual_seed(spec.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    if config.num_moe_experts and not all(moe_layer_pattern(config)):  # dense and MoE layers by moe_layer_freq
        layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layers = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=bool(config.moe_grouped_gemm),
            qk_layernorm=config.qk_layernorm,
            normalization="RMSNorm",
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layers,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    # Norm weights start at 1 and QKV biases at 0; perturb them (the same global
    # values at every TP/PP layout) so a swapped or dropped norm/bias shows in the logits.
    with torch.no_grad():
        for key, p in _perturbed_params(model):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{spec.seed}:{key}".encode()))
            if getattr(p, "tensor_model_parallel", False):
                tp, rank = (
                    parallel_state.get_tensor_model_parallel_world_size(),
                    parallel_state.get_tensor_model_parallel_rank(),
                )
                full = torch.randn((p.shape[0] * tp, *p.shape[1:]), generator=gen) * 0.1
                noise = full[rank * p.shape[0] : (rank + 1) * p.shape[0]]
            else:
                noise = torch.randn(p.shape, generator=gen) * 0.1
            p.add_(noise.to(p.device, p.dtype))
        _redraw_experts(spec, config, model)
    return model.to(device)


def _redraw_experts(spec: TinyLlamaSpec, config, model) -> None:
    """Each expert's weights from its global index (CPU init repeats the local
    experts on every EP rank), and a router strong enough for clear top-k choices.
    With expert TP each rank keeps its shard of the whole expert (GLU ``linear_fc1``:
    ``[gate_r; up_r]``), so the global model does not depend on the expert-TP degree."""
    from megatron.core import parallel_state

    if not config.num_moe_experts:
        return
    num_local = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * num_local
    etp, etp_rank = (
        parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )
    for layer in model.decoder.layers:
        for name, p in layer.mlp.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["experts", "local_experts"]:
                key, scale = f"expert{first + int(parts[2])}.{'.'.join(parts[3:])}", 0.1
            elif name == "router.weight":
                key, scale = "router", 0.5
            else:
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(f"{spec.seed}:layer{layer.layer_number}.{key}".encode()))
            if key == "router" or etp == 1:
                p.copy_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))
                continue
            dim = 0 if parts[-2] == "linear_fc1" else 1  # column- / row-parallel expert linears
            shape = list(p.shape)
            shape[dim] *= etp
            full = torch.randn(shape, generator=gen) * scale
            if dim == 0 and config.gated_linear_unit:
                shard = torch.cat([half.chunk(etp)[etp_rank] for half in full.chunk(2)])
            else:
                shard = full.chunk(etp, dim)[etp_rank]
            p.copy_(shard.to(p.device, p.dtype))


class _TEGroupedMLPNames(torch.nn.Module):
    """A SequentialMLP's expert weights under TEGroupedMLP's names
    (``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``, the same Parameter
    objects, with TE's partition attributes); forward runs the SequentialMLP,
    kept out of the module tree so every weight is listed once, under TE's name."""

    def __init__(self, sequential):
        super().__init__()
        self._sequential = (sequential,)
        self.linear_fc1, self.linear_fc2 = torch.nn.Module(), torch.nn.Module()
        for i, expert in enumerate(sequential.local_experts):
            for fc, partition_dim in (("linear_fc1", 0), ("linear_fc2", 1)):  # column / row parallel
                p = getattr(expert, fc).weight
                if getattr(expert, fc).bias is not None:
                    raise ValueError("the stand-in renames expert weights only (add_bias_linear=False)")
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, partition_dim, 1
                getattr(self, fc).register_parameter(f"weight{i}", p)

    def forward(self, *args, **kwargs):
        return self._sequential[0](*args, **kwargs)


def as_te_grouped_moe(model):
    """Rename, in place, a local-spec SequentialMLP MoE GPTModel's parameters to
    what Megatron's Transformer Engine layer spec with ``moe_grouped_gemm=True``
    names them (TE cannot run on CPU): ``input_layernorm.weight`` becomes
    ``self_attention.linear_qkv.layer_norm_weight`` (listed first, as TE's
    LayerNormLinear does), ``pre_mlp_layernorm.weight`` stays (TE keeps a
    separate norm before an MoE layer), and each local expert's weights become
    TEGroupedMLP's ``mlp.experts.linear_fc{1,2}.weight{i}``; a dense MLP layer
    (``moe_layer_freq``) has its ``pre_mlp_layernorm.weight`` as
    ``mlp.linear_fc1.layer_norm_weight`` (TE's LayerNormLinear, as for the input
    norm). The parameters are the same objects and forward is unchanged (the
    same logits). Returns ``model``."""

    def fuse(norm, linear):
        weight = norm._parameters.pop("weight")
        object.__setattr__(norm, "weight", weight)  # still used by its forward, no longer listed
        linear._parameters = {"layer_norm_weight": weight, **linear._parameters}

    for layer in model.decoder.layers:
        fuse(layer.input_layernorm, layer.self_attention.linear_qkv)
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, "local_experts"):
            layer.mlp.experts = _TEGroupedMLPNames(experts)
        elif experts is None:  # a dense MLP layer
            fuse(layer.pre_mlp_layernorm, layer.mlp.linear_fc1)
    return model


def _perturbed_params(model):
    """(global key, param) of every norm weight and bias, keyed by global layer number."""
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", []):
        for name, p in layer.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                yield f"layer{layer.layer_number}.{name}", p
    final = getattr(decoder, "final_layernorm", None)
    if final is not None:
        for name, p in final.named_parameters():
            yield f"final.{name}", p


def hf_model(spec: TinyLlamaSpec, config, dtype=torch.float32):
    """An HF ``*ForCausalLM`` of the same shape with its own random weights (no downloads)."""
    import transformers

    from megatron_ext.weight_export import hf_config_from_megatron

    hf_cfg = hf_config_from_megatron(
        config,
        arch=spec.arch,
        vocab_size=spec.hf_vocab_size,
        max_position_embeddings=max(64, spec.seq_length),
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_embeddings,
    )
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[spec.arch]
    torch.manual_seed(spec.seed + 7)
    return cls(hf_cfg).to(dtype).eval()


def tokens(spec: TinyLlamaSpec, batch: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.hf_vocab_size, (batch, spec.seq_length), generator=gen)


def build_hf(spec: TinyLlamaSpec, dtype=torch.float32):
    """The HF model for ``spec`` without a process group (receiver processes)."""
    return hf_model(spec, transformer_config(spec), dtype=dtype)
