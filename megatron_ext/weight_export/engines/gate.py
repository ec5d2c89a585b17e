"""Checking a refit: the same tokens through the Megatron model and the engine.

:func:`verify_export` compares two logit tensors (max difference, per-token KL);
:func:`megatron_logits` runs the trainer's model; :class:`RefitGate` checks an
engine rank after each reshard refit and refuses the version when it fails."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["RefitGate", "VerifyResult", "megatron_logits", "verify_export"]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float  # max |logit difference|
    kl: float  # KL(trainer || receiver), mean over tokens

    def ok(self, *, max_kl: float = 1e-3) -> bool:
        return self.kl <= max_kl


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[batch, seq, vocab]`` of a Megatron GPT model
    (one pipeline stage; TP-sharded logits are gathered). Call on every TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from ...sharding.names import unwrap

    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError(
            "megatron_logits needs pipeline size 1; pass reference logits from "
            "your pipeline schedule to verify_export(reference_logits=...)"
        )
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
    ref = ref[..., : got.shape[-1]]
    if ref.shape != got.shape:
        raise ValueError(f"logit shapes differ: trainer {tuple(ref.shape)} vs receiver {tuple(got.shape)}")
    logp = F.log_softmax(ref, dim=-1)
    logq = F.log_softmax(got, dim=-1)
    # Per-token KL is >= 0; identical models give tiny negative values from rounding.
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0).mean().item()
    return VerifyResult((ref - got).abs().max().item(), kl)


class RefitGate:
    """Checks an engine rank after each refit: its logits on ``tokens`` against
    the trainer's ``reference`` logits (a tensor, or ``reference(version)``).

    ``consumer`` needs ``logits(tokens)``; with ``load=True`` the rank's whole HF
    tensors (``dst.hf_tensors(rank, tensors)``) are first fed to its
    ``load_weights`` (e.g. :class:`~.receiver.HFModelConsumer` on a TP1 replica).
    Pass ``load=False`` when the refit writes straight into the engine's
    weights. The gate passes when ``kl <= max_kl`` (and, if given,
    ``max_abs_diff <= max_logit_diff``), both finite: NaN or Inf logits fail it.
    Otherwise the refit raises :class:`~..plan.errors.RefitRejected` (``on_fail="raise"``) or only
    records the result (``"report"``). ``max_kl`` / ``max_logit_diff`` must be
    finite numbers >= 0.
    """

    def __init__(
        self,
        consumer,
        tokens: torch.Tensor,
        reference: torch.Tensor | Callable[[int], torch.Tensor],
        *,
        max_kl: float = 1e-3,
        max_logit_diff: float | None = None,
        on_fail: str = "raise",
        load: bool = True,
    ):
        if on_fail not in ("raise", "report"):
            raise ValueError(f"on_fail must be 'raise' or 'report', got {on_fail!r}")
        for arg, value in (("max_kl", max_kl), ("max_logit_diff", max_logit_diff)):
            if value is None and arg == "max_logit_diff":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"RefitGate: {arg} must be a finite number >= 0, got {value!r}")
        self.consumer, self.tokens, self.reference = consumer, tokens, reference
        self.max_kl, self.max_logit_diff, self.on_fail, self.load = max_kl, max_logit_diff, on_fail, load
        self.last: VerifyResult | None = None
        self._nonfinite: str | None = None  # which logits of the last check were not finite

    def __call__(self, layout, rank: int, tensors: dict[str, torch.Tensor], version: int) -> VerifyResult:
        if self.load:
            self.consumer.load_weights(layout.hf_tensors(rank, tensors))
        ref = self.reference(version) if callable(self.reference) else self.reference
        got = self.consumer.logits(self.tokens)
        self.last = verify_export(ref, got)
        bad = [
            what
            for what, t in (("the trainer's reference logits", ref), ("the engine's logits", got))
            if not bool(torch.isfinite(t).all())
        ]
        self._nonfinite = " and ".join(bad) or None
        return self.last

    def passes(self, result: VerifyResult) -> bool:
        """``kl <= max_kl`` (and ``max_abs_diff <= max_logit_diff``, if given), both finite."""
        if not (math.isfinite(result.kl) and math.isfinite(result.max_abs_diff)):
            return False
        return result.ok(max_kl=self.max_kl) and (
            self.max_logit_diff is None or result.max_abs_diff <= self.max_logit_diff
        )

    def why(self, result: VerifyResult) -> str:
        """Why ``result`` fails the gate, in words."""
        if not (math.isfinite(result.kl) and math.isfinite(result.max_abs_diff)):
            return (
                f"the logits are not finite ({self._nonfinite or 'NaN/Inf'}: KL {result.kl:.3g}, "
                f"max logit diff {result.max_abs_diff:.3g})"
            )
        limits = f"max_kl {self.max_kl:g}" + (
            "" if self.max_logit_diff is None else f", max_logit_diff {self.max_logit_diff:g}"
        )
        return f"KL {result.kl:.3g}, max logit diff {result.max_abs_diff:.3g} ({limits})"
