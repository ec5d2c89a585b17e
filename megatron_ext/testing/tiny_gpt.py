"""A tiny megatron-core GPTModel (local layer spec, norms :class:`~megatron_ext.layers.LocalNorm`) and synthetic data.

Shared by the tests, the demo and the benchmarks. Weights are initialised on
CPU from the global seed (``use_cpu_initialization``), so the same seed gives
the same *global* model at every TP degree: shards differ, the model does not.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TinyGPTSpec:
    """Shape of the tiny model and its synthetic data."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: no GQA
    ffn_hidden_size: int = 128
    gated_linear_unit: bool = False
    qk_layernorm: bool = False  # layer norms of the queries and keys (their grads are partial per TP rank)
    normalization: str = "LayerNorm"  # or "RMSNorm" (megatron_ext.layers.LocalNorm builds either)
    vocab_size: int = 128
    share_embeddings: bool = False  # the output layer is the word embedding (across pipeline stages: tied)
    seq_length: int = 16
    micro_batch_size: int = 2
    seed: int = 1234


def transformer_config(spec: TinyGPTSpec, tp: int = 1, pp: int = 1, **overrides):
    """A TransformerConfig for ``spec`` on the local layer spec without fused kernels."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.sharding import UNFUSED_LOCAL_SPEC

    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated_linear_unit,
        qk_layernorm=spec.qk_layernorm,
        normalization=spec.normalization,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        **UNFUSED_LOCAL_SPEC,
    )
    if spec.gated_linear_unit:
        kwargs["activation_func"] = torch.nn.functional.silu
    kwargs.update(overrides)
    kwargs.setdefault("pipeline_dtype", kwargs["params_dtype"])  # what the stages send each other
    return TransformerConfig(**kwargs)


def build_model(spec: TinyGPTSpec, config, device: torch.device | str = "cpu"):
    """Build the GPTModel for this rank's model-parallel shard.

    Seeds the global RNG first so every TP/PP layout draws the same global
    weights. Call after ``parallel_state.initialize_model_parallel``.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.layers import local_gpt_block_spec

    torch.manual_seed(spec.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    model = GPTModel(
        config=config,
        # the local spec, its norms LocalNorm (sequence parallelism without TE / Apex)
        transformer_layer_spec=local_gpt_block_spec(config),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=spec.share_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    return model.to(device)


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL, else CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_batch(spec: TinyGPTSpec, step: int, num_samples: int):
    """Deterministic tokens and labels for one optimizer step: ``[num_samples, seq]``.

    Each sequence starts at a random token and follows ``x -> (5x + 3) mod vocab``,
    so the next token is learnable and the loss falls quickly from ~ln(vocab).
    """
    gen = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, spec.vocab_size, (num_samples, 1), generator=gen)
    seq = [start]
    for _ in range(spec.seq_length):
        seq.append((seq[-1] * 5 + 3) % spec.vocab_size)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def forward_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``model`` on one micro-batch."""
    seq = tokens.shape[1]
    device = tokens.device
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)
    attention_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
    per_token = model(tokens, position_ids, attention_mask, labels=labels)
    return per_token.float().mean()


def train_step(model, optimizer, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One optimizer step of a Megatron DDP-wrapped ``model`` on this rank's
    micro-batch: zero the grad buffer, forward, backward, grad sync, step.
    Returns this rank's (detached) loss."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_loss(model, tokens, labels)
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()
    return loss.detach()
