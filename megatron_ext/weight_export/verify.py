"""A refit gate: the same tokens through the Megatron model and the receiver."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

__all__ = ["VerifyResult", "megatron_logits", "verify_export"]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float   # max |logit difference|
    kl: float             # KL(trainer || receiver), mean over tokens

    def ok(self, *, max_kl: float = 1e-3) -> bool:
        return self.kl <= max_kl


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[batch, seq, vocab]`` of a Megatron GPT model
    (one pipeline stage; TP-sharded logits are gathered). Call on every TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from ..sharding.names import unwrap

    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("megatron_logits needs pipeline size 1; pass reference logits from "
                                  "your pipeline schedule to verify_export(reference_logits=...)")
    model = unwrap(model)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
    logits = model(tokens, position_ids, mask)
    model.train(was_training)
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits.float()


def verify_export(reference_logits: torch.Tensor, receiver_logits: torch.Tensor) -> VerifyResult:
    """Max logit difference and per-token mean KL between trainer and receiver.

    Megatron's padded vocabulary is trimmed to the receiver's. Typical use after
    each refit (see :meth:`WeightExporter.verify`)::

        result = verify_export(megatron_logits(model, tokens), engine_logits)
        assert result.ok(max_kl=1e-3), result
    """
    ref = reference_logits.float().cpu()
    got = receiver_logits.float().cpu()
    ref = ref[..., :got.shape[-1]]
    if ref.shape != got.shape:
        raise ValueError(f"logit shapes differ: trainer {tuple(ref.shape)} vs receiver {tuple(got.shape)}")
    logp = F.log_softmax(ref, dim=-1)
    logq = F.log_softmax(got, dim=-1)
    # Per-token KL is >= 0; identical models give tiny negative values from rounding.
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0).mean().item()
    return VerifyResult((ref - got).abs().max().item(), kl)
