"""``finalize_model_grads`` for NTP jobs with ``calculate_per_token_loss``.

Megatron's ``finalize_model_grads`` sums the token count over the DP group and
divides the gradients by it. A degraded replica takes part in no DP collective
(its gradients join its partner's bucket), so its tokens must join its
partner's count first. This wrapper does that (one all-reduce of one number over
each pair of replicas) and then calls Megatron's function unchanged. Bystanders
and uniform jobs go straight to Megatron's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["finalize_model_grads"]


def finalize_model_grads(model, num_tokens: torch.Tensor | None = None, pg_collection=None, force_all_reduce=False):
    """Megatron's ``finalize_model_grads(model, num_tokens, pg_collection, force_all_reduce)``,
    with a degraded replica's token count added to its partner's before it. Set it as
    ``config.finalize_model_grads_func`` in jobs with ``calculate_per_token_loss``."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads as megatron_finalize

    for chunk in model:
        pair = getattr(chunk, "_pair", None)
        if pair is None:
            continue
        if num_tokens is not None:
            # Both sides first finish this step's gradient transfers (in the partner's order, as they
            # would in finish_grad_sync: the pair's collectives must come in one order on every rank).
            pair.flush()
            # the partner's count and the satellite's, once each (TP rank 0 of either side), on every rank of the pair
            total = num_tokens.clone() if chunk._ntp_groups.role.tp_rank == 0 else torch.zeros_like(num_tokens)
            dist.all_reduce(total, group=pair.group)
            num_tokens.copy_(total)
        chunk._tokens_shared = True
    return megatron_finalize(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
