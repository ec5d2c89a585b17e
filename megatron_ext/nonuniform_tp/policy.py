"""``--ntp-policy auto|degrade|drop``: whether the replicas that lost GPUs train at the
reduced degree (as satellites of healthy partners) or leave the job.

``auto`` predicts the step of both with :mod:`.cost_model` and takes the faster: NTP's
shares (balanced with ``--ntp-balance tp|measured``, the shrinking batch with ``shrink``, else
equal) and their micro-batch
granularity against the healthy replicas sharing the same global batch alone (equally: a
global batch that does not split so is not dropped). The costs
are relative to one healthy micro-batch; a pair's transfers are taken as
:data:`TRANSFER_FRACTION` of a uniform step (measured with the partner design: a partner rank
receiving its satellite's gradients for one shard and sending it the shard's parameters took
19.3 + 9.4 ms against a uniform step of 981 ms, 2.92%, for a 2.0B GPT at TP2 on 4xH200,
``benchmarks/results/ntp_2b_4xH200_2026-11-26.json``). Without the global batch (a config
built in code, not from Megatron's flags), ``auto`` degrades: with real-valued shares NTP never loses to dropping.
"""

from __future__ import annotations

import dataclasses
import logging

from . import cost_model

__all__ = ["POLICIES", "PolicyDecision", "TRANSFER_FRACTION", "decide"]

logger = logging.getLogger(__name__)

POLICIES = ("auto", "degrade", "drop")
TRANSFER_FRACTION = 0.0292


@dataclasses.dataclass(frozen=True)
class PolicyDecision:
    """``choice``: ``"degrade"`` or ``"drop"``; the predicted throughputs of both relative to
    the uniform job (None where not predicted); ``line``: what ``auto`` logs."""

    choice: str
    degrade: float | None = None
    drop: float | None = None
    line: str = ""


def decide(config, num_replicas: int, global_batch_size: int | None, micro_batch_size: int | None) -> PolicyDecision:
    """What ``config.policy`` does for a job of ``num_replicas`` replicas (logs one INFO line for
    ``auto`` when it predicts)."""
    failed = config.degraded_replicas
    if not failed or config.policy != "auto":
        return PolicyDecision("drop" if config.policy == "drop" and failed else "degrade")
    if not global_batch_size or not micro_batch_size or global_batch_size % micro_batch_size:
        return PolicyDecision("degrade", line="no global batch to predict with: degrade")
    total = global_batch_size // micro_batch_size
    by_stage = config.failed_slots_by_stage
    # a replica's degree is set by its worst stage
    lost = [max((len(v) for (r, _), v in by_stage.items() if r == d), default=0) for d in range(num_replicas)]
    costs = cost_model.StepCosts(
        microbatch_s=1.0,
        grad_transfer_s=TRANSFER_FRACTION / 2 * total / num_replicas,
        param_transfer_s=TRANSFER_FRACTION / 2 * total / num_replicas,
    )
    mode = {"none": "ntp unbalanced", "shrink": "ntp shrink"}.get(config.balance, "ntp balanced")
    pp = config.pipeline_model_parallel_size
    ntp = cost_model.predict_retained(
        costs, config.tp_base, lost, total, mode, max_shrink=config.max_shrink, tp_reduced=config.tp_reduced, pp=pp
    )
    drop = cost_model.predict_retained(costs, config.tp_base, lost, total, "drop", tp_reduced=config.tp_reduced, pp=pp)
    healthy = num_replicas - len(failed)  # (failed: the degraded replicas)
    drop_text = "n/a" if drop is None else f"{drop:.1%}"
    if total % healthy:  # a dropped job splits the global batch equally over the healthy replicas
        drop, drop_text = None, f"n/a ({total} micro-batches do not split over {healthy} replicas)"
    choice = "drop" if drop is not None and (ntp is None or drop > ntp) else "degrade"
    hint = ""
    if config.balance == "none":  # what balanced shares would give: equal ones leave the straggler in
        balanced = cost_model.predict_retained(
            costs, config.tp_base, lost, total, "ntp balanced", tp_reduced=config.tp_reduced, pp=pp
        )
        if balanced is not None and ntp is not None and balanced > max(ntp, drop or 0.0):
            hint = f"; with --ntp-balance tp: degrade {balanced:.1%}"
    line = (
        f"nonuniform TP (--ntp-policy auto): {len(failed)} degraded replica(s) of {num_replicas}; predicted "
        f"throughput of the uniform job's: degrade to TP {config.tp_reduced} ({mode}) "
        f"{'n/a' if ntp is None else f'{ntp:.1%}'}, drop {drop_text} "
        f"({total} micro-batches of {micro_batch_size} per global batch){hint}: {choice}"
    )
    logger.info("%s", line)
    return PolicyDecision(choice, ntp, drop, line)
