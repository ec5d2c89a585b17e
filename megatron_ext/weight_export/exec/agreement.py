"""Before a reshard refit moves a byte, every rank agrees that all of them can take part.

Every rank of the group reports one int64 and a short note
(:meth:`~..control.peers.Peers.gather_notes`): its wire id (:func:`~..plan.wire.wire_id`: every
rank's slot size and pairs' digest, gathered just before, the pairs' phases and the checks), or a refusal code,
:data:`~..plan.wire.BAD_TENSORS` (its tensors are not the layout's; the note says
which and how, from :func:`tensor_problem`) or :data:`~..plan.wire.NO_STAGING` (its
staging buffers did not fit in device memory or in the memory budget). :func:`settle` turns the
gathered reports into the same decision on every rank: go on, or raise
:class:`~..plan.errors.RefitRejected` with reason ``"tensors"``, ``"staging"`` or
``"plan"`` (also when the two ends of some pair planned other transfers), naming the ranks and
quoting their notes, so that no rank waits for a peer that will not send.
"""

from __future__ import annotations

import torch

from ..plan.errors import RefitRejected
from ..plan.reshard_plan import ReshardPlan
from ..plan.wire import BAD_TENSORS, NO_STAGING

__all__ = ["out_of_memory", "settle", "tensor_problem", "tensors_rejected"]


def tensor_problem(plan: ReshardPlan, rank: int, tensors: dict[str, torch.Tensor], who: str) -> str | None:
    """What is wrong with ``rank``'s tensors for ``plan`` (the first problem), or None. A tensor may
    have more rows than the layout keeps (Megatron's padded vocabulary)."""
    for layout in (plan.src, plan.dst):
        for name, lt in layout.tensors.get(rank, {}).items():
            t = tensors.get(name)
            if t is None:
                return f"{who}: the plan needs local tensor {name!r} ({layout.description}); pass it in `tensors`" + (
                    " (a nonuniform-TP trainer: ntp_megatron_tensors(ddp))" if layout is plan.src else ""
                )
            if tuple(t.shape[1:]) != lt.shape[1:] or t.shape[0] < lt.shape[0] or t.dtype != lt.dtype:
                return (
                    f"{who}: {name} is {tuple(t.shape)} {t.dtype}, the layout keeps {lt.shape} "
                    f"{lt.dtype}; build the layout from this model's config (a nonuniform-TP trainer: "
                    "pass ntp_megatron_tensors(ddp), not ddp.module, which is empty on a degraded replica)"
                )
            if not t.is_contiguous():
                return f"{who}: {name} must be contiguous"
    return None


def tensors_rejected(bad: list[tuple[int, str]], *, who: str, word: str, problem: str | None) -> RefitRejected:
    """The error every rank raises when ranks ``bad`` (``(rank, problem)``) cannot take part: a rank
    with its own ``problem`` gives it, the others name the ranks and quote the first problems."""
    if problem is not None:
        return RefitRejected(f"{problem}. Every rank of the refit refused it; nothing was sent", reason="tensors")
    return RefitRejected(
        f"{who}: {word}s {[r for r, _ in bad]} cannot take part in the refit, nothing "
        "was sent: " + " | ".join(n for _, n in bad[:2]),
        reason="tensors",
    )


def out_of_memory(
    exc: BaseException,
    who: str,
    *,
    need: int,
    received: int,
    atomic: bool,
    max_inflight: int,
    bucket_bytes: int,
) -> RefitRejected:
    """The error of a rank that could not allocate ``need`` bytes of staging buffers: how to need less."""
    err = RefitRejected(
        f"{who}: out of device memory for {need / 2**30:.2f} GiB of reshard staging buffers "
        + (
            f"(atomic=True stages the whole version this rank receives, {received / 2**30:.2f} GiB; "
            "atomic=False stages max_inflight buckets per peer instead)"
            if atomic and received
            else f"(max_inflight={max_inflight} buckets of up to {bucket_bytes / 2**20:g} MiB per peer)"
        )
        + "; lower bucket_bytes or max_inflight, or free memory before the refit. Nothing was sent.",
        reason="staging",
    )
    err.__cause__ = exc
    return err


def settle(
    got: list[tuple[int, str]],
    ranks: list[int],
    *,
    who: str,
    word: str,
    problem: str | None = None,
    own: RefitRejected | None = None,
    pairs_agree: bool = True,
) -> None:
    """Raise, on every rank alike, if any rank cannot take part or runs another plan.

    ``got``: every rank's ``(code, note)`` in group order, ``ranks`` their plan ranks; ``who``
    names this rank and ``word`` one rank in messages; ``problem``: this rank's own
    :func:`tensor_problem`; ``own``: this rank's :func:`out_of_memory` error; ``pairs_agree``: whether the two
    ends of every pair planned the same transfers (from digests every rank gathered, so the same on every rank).
    Checked in order: tensors (``"tensors"``), staging memory (``"staging"``), then the pairs and that every
    wire id is the same (``"plan"``, naming the ranks that differ from the most common one)."""
    codes = dict(zip(ranks, (v for v, _ in got)))
    bad = [(r, note) for r, (v, note) in zip(ranks, got) if v == BAD_TENSORS]
    if bad:
        raise tensors_rejected(bad, who=who, word=word, problem=problem)
    if own is not None:
        raise own
    short = [r for r, v in codes.items() if v == NO_STAGING]
    if short:
        raise RefitRejected(
            f"{who}: {word}s {short} cannot hold their staging buffers (out of device memory or over the memory "
            "budget; their errors say how much); nothing was sent",
            reason="staging",
        )
    if not pairs_agree:
        raise RefitRejected(
            f"{who}: the two ends of some pair of {word}s planned different transfers; nothing was sent. Build the "
            "same layouts (specs, TP/PP/DP/EP, ranks, vocab padding) on every rank, with the same release of "
            "megatron_ext",
            reason="plan",
        )
    values = list(codes.values())
    if len(set(values)) > 1:
        common = max(set(values), key=lambda v: (values.count(v), -values.index(v)))
        raise RefitRejected(
            f"{who}: {word}s {[r for r, v in codes.items() if v != common]} run another reshard plan or "
            f"bucket_bytes than {word}s {[r for r, v in codes.items() if v == common]}; nothing was sent. Build "
            "the same layouts (specs, TP/PP/DP/EP, ranks, vocab padding) and give every rank the same "
            "zero_copy_bytes, check_finite and min_op_bytes (--refit-zero-copy-mb, --refit-check-finite; the "
            "executor's min_op_bytes sets the pairs' phases), and where a rank was "
            "given the whole plan also the same bucket_bytes and memory budget (--refit-bucket-size-mb, "
            "--refit-memory-budget-mb)",
            reason="plan",
        )
