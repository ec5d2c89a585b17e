"""User-facing configuration of nonuniform tensor parallelism (NTP).

A job has ``data_parallel_size`` replicas, each normally running at TP degree
``tp_base`` in each of its ``pipeline_model_parallel_size`` stages.
``non_active_ranks_per_dp`` maps a replica index (with pipeline stages: a
``(replica, stage)`` pair) to the TP slots (``0..tp_base-1``) whose GPUs are out;
every degraded replica runs every stage at the same reduced degree
``tp_base - tp_spares`` on its remaining slots.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Mapping

from .balance import SHARE_UNITS
from .cost_model import reduced_degree
from .layout import NTPLayout, pair_up
from .policy import POLICIES, TRANSFER_FRACTION, decide

__all__ = [
    "NonuniformTPConfig",
    "add_nonuniform_tp_args",
    "compute_uniform_tp_spares_with_parity",
    "format_failed_slots",
    "parse_failed_slots",
]

logger = logging.getLogger(__name__)

LAUNCH_MODES = ("packed", "simulate")
BALANCE_MODES = ("none", "tp", "measured", "shrink")


@dataclasses.dataclass
class NonuniformTPConfig:
    """Which GPUs are out, and how the job is launched.

    Args:
        tp_base: TP degree of a healthy replica.
        tp_spares: how many TP slots each degraded replica has lost (after
            parity, see :func:`compute_uniform_tp_spares_with_parity`); a
            degraded replica runs at ``tp_reduced = tp_base - tp_spares``.
        non_active_ranks_per_dp: replica index -> TP slots that are out. Every
            listed replica must list exactly ``tp_spares`` slots. Every replica
            may be listed (the job is then uniform TP at ``tp_reduced``). With
            ``pipeline_model_parallel_size`` > 1 the keys are ``(replica, stage)``
            pairs and a listed replica lists every stage (a replica that lost GPUs
            in one stage runs every stage at ``tp_reduced``, so that the activations
            between stages keep their shapes).
        pipeline_model_parallel_size: Megatron's ``--pipeline-model-parallel-size``:
            stages per replica (an int >= 1).
        data_parallel_size: number of replicas; ``None`` derives it from the
            world size in :meth:`layout`.
        launch_mode: ``"packed"``: the failed GPUs have no process, the job
            runs on the healthy GPUs only (world = healthy GPUs). ``"simulate"``:
            every slot has a process and the non-active ones leave (tests).
        num_attention_heads, num_query_groups, ffn_hidden_size, vocab_size:
            optional model shape; when given, checked to split at both degrees.
        sequence_parallel, seq_length: Megatron's ``--sequence-parallel`` (on every replica at TP > 1; a
            degraded replica at TP 1 runs without, as Megatron refuses it there) and ``--seq-length``;
            with both, the sequence is checked to split at both degrees.
        balance: how each global batch is shared among the replicas
            (:meth:`batch_shares`). ``"none"``: equal shares, as Megatron.
            ``"tp"``: micro-batches in proportion to each replica's TP degree,
            so a degraded replica gets ``tp_reduced / tp_base`` of a healthy
            share. ``"measured"``: the ``"tp"`` shares for the first
            ``balance_measure_steps`` steps, then shares by the replicas'
            measured throughputs (:class:`~megatron_ext.nonuniform_tp.balance.MeasuredBalance`).
            ``"shrink"``: every replica keeps its per-step work and the global batch shrinks by the
            degraded replicas' shortfall, at most ``max_shrink`` of it
            (:func:`~megatron_ext.nonuniform_tp.balance.shrunk_batch_shares`).
        balance_measure_steps: with ``balance="measured"``, how many steps are
            timed before the shares change (an int >= 1).
        transfer_chunk_mb: the largest unit (MiB of fp32 gradient, all that one exchange moves
            over the pair; larger tensors are cut) in which a degraded replica's gradients go to its
            partner and the parameters come back; the transfers' staging on each rank is at most
            this size per dtype (> 0).
        policy: what the replicas that lost GPUs do (:mod:`.policy`): ``"degrade"``: train at
            ``tp_reduced``, each the satellite of a healthy partner; ``"drop"``: leave the job (their
            processes get an inactive state, the healthy replicas share the global batch);
            ``"auto"``: the faster of the two by the cost model, where ``from_args`` knows the global
            batch (else degrade).
        max_shrink: with ``balance="shrink"``, the largest fraction of the global batch left out
            per step (in [0, 1), default 0.05).
        share_unit: what the unequal shares of ``balance`` count: ``"microbatch"`` (whole
            micro-batches, default) or ``"sample"`` (samples; a replica's last micro-batch may be
            partial, which needs Megatron's ``calculate_per_token_loss``).
    """

    tp_base: int
    tp_spares: int = 0
    non_active_ranks_per_dp: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    data_parallel_size: int | None = None
    launch_mode: str = "packed"
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None
    balance: str = "none"
    balance_measure_steps: int = 5
    transfer_chunk_mb: float = 64.0
    policy: str = "auto"
    max_shrink: float = 0.05
    share_unit: str = "microbatch"
    sequence_parallel: bool = False
    seq_length: int | None = None
    pipeline_model_parallel_size: int = 1

    def __post_init__(self):
        if not isinstance(self.tp_base, int) or self.tp_base < 1:
            raise ValueError(f"NonuniformTPConfig.tp_base must be an int >= 1, got {self.tp_base!r}")
        if not isinstance(self.tp_spares, int) or not 0 <= self.tp_spares < self.tp_base:
            raise ValueError(
                f"NonuniformTPConfig.tp_spares must be in 0..{self.tp_base - 1} (tp_base - 1; "
                f"a replica needs at least one GPU), got {self.tp_spares!r}"
            )
        if self.launch_mode not in LAUNCH_MODES:
            raise ValueError(f"NonuniformTPConfig.launch_mode must be one of {LAUNCH_MODES}, got {self.launch_mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"NonuniformTPConfig.policy (--ntp-policy) must be one of {POLICIES}, got {self.policy!r}")
        if self.balance not in BALANCE_MODES:
            raise ValueError(
                f"NonuniformTPConfig.balance (--ntp-balance) must be one of {BALANCE_MODES}, got {self.balance!r}"
            )
        steps = self.balance_measure_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(
                "NonuniformTPConfig.balance_measure_steps (--ntp-balance-measure-steps) must be an int >= 1 (the "
                f"steps timed before --ntp-balance measured sets the shares), got {steps!r}"
            )
        if self.share_unit not in SHARE_UNITS:
            raise ValueError(
                f"NonuniformTPConfig.share_unit (--ntp-share-unit) must be one of {SHARE_UNITS}, got "
                f"{self.share_unit!r}"
            )
        shrink = self.max_shrink
        if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0 <= shrink < 1:
            raise ValueError(
                "NonuniformTPConfig.max_shrink (--ntp-max-shrink) must be a number in [0, 1) (the largest fraction "
                f"of the global batch --ntp-balance shrink may leave out), got {shrink!r}"
            )
        chunk = self.transfer_chunk_mb
        if isinstance(chunk, bool) or not isinstance(chunk, (int, float)) or not 0 < chunk < float("inf"):
            raise ValueError(
                "NonuniformTPConfig.transfer_chunk_mb (--ntp-transfer-chunk-mb) must be a number > 0 (MiB of fp32 "
                f"gradient per transfer unit), got {chunk!r}"
            )
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            raise ValueError(
                f"NonuniformTPConfig.data_parallel_size must be >= 1 or None, got {self.data_parallel_size!r}"
            )
        pp = self.pipeline_model_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ValueError(
                "NonuniformTPConfig.pipeline_model_parallel_size (--pipeline-model-parallel-size) must be an int >= 1, "
                f"got {pp!r}"
            )
        normalized = {}
        for key, slots in dict(self.non_active_ranks_per_dp).items():
            replica, stage = self._split_key(key)
            if (
                not isinstance(replica, int)
                or replica < 0
                or (self.data_parallel_size is not None and replica >= self.data_parallel_size)
            ):
                upper = "" if self.data_parallel_size is None else f"..{self.data_parallel_size - 1}"
                raise ValueError(
                    f"NonuniformTPConfig.non_active_ranks_per_dp: replica index {replica!r} is out of "
                    f"range; allowed: 0{upper} (data_parallel_size={self.data_parallel_size})"
                )
            slots = tuple(slots)
            for s in slots:
                if not isinstance(s, int) or not 0 <= s < self.tp_base:
                    raise ValueError(
                        f"NonuniformTPConfig.non_active_ranks_per_dp[{key!r}]: slot {s!r} is out of "
                        f"range; allowed: 0..{self.tp_base - 1} (tp_base={self.tp_base})"
                    )
            if len(set(slots)) != len(slots):
                raise ValueError(
                    f"NonuniformTPConfig.non_active_ranks_per_dp[{key!r}]: duplicated slot in {slots}; "
                    "list each failed TP slot once"
                )
            if len(slots) != self.tp_spares:
                raise ValueError(
                    f"NonuniformTPConfig.non_active_ranks_per_dp[{key!r}] lists {len(slots)} slot(s) "
                    f"but tp_spares={self.tp_spares}: every degraded replica must deactivate exactly "
                    "tp_spares slots"
                    + (" in every stage" if pp > 1 else "")
                    + "; use compute_uniform_tp_spares_with_parity() to derive both"
                )
            if (replica, stage) in normalized:
                raise ValueError(
                    f"NonuniformTPConfig.non_active_ranks_per_dp lists replica {replica}"
                    + (f", stage {stage}" if pp > 1 else "")
                    + " twice"
                )
            normalized[(replica, stage)] = tuple(sorted(slots))
        if self.tp_spares > 0 and not normalized:
            raise ValueError(
                f"NonuniformTPConfig.tp_spares={self.tp_spares} but non_active_ranks_per_dp is empty; "
                "set tp_spares=0 or list the failed slots"
            )
        for replica in sorted({d for d, _ in normalized}):
            missing = [p for p in range(pp) if (replica, p) not in normalized]
            if missing:
                raise ValueError(
                    f"NonuniformTPConfig.non_active_ranks_per_dp lists replica {replica} in stage(s) "
                    f"{sorted(set(range(pp)) - set(missing))} but not in stage(s) {missing}: a degraded replica runs "
                    f"every stage at tp_reduced={self.tp_reduced}, so every stage lists its {self.tp_spares} inactive "
                    "slot(s); use compute_uniform_tp_spares_with_parity() to fill them"
                )
        items = sorted(normalized.items())
        self.non_active_ranks_per_dp = {d if pp == 1 else (d, p): v for (d, p), v in items}
        self._check_model_shape()

    def _split_key(self, key) -> tuple[int, int]:
        """A key of ``non_active_ranks_per_dp`` as ``(replica, stage)``: a replica index alone
        (one stage), or a ``(replica, stage)`` pair (refused where the stage is out of range)."""
        pp = self.pipeline_model_parallel_size
        if isinstance(key, tuple):
            if len(key) != 2 or not all(isinstance(k, int) and not isinstance(k, bool) for k in key):
                raise ValueError(
                    f"NonuniformTPConfig.non_active_ranks_per_dp: key {key!r} is not a replica index or a "
                    "(replica, stage) pair of ints"
                )
            replica, stage = key
            if not 0 <= stage < pp:
                raise ValueError(
                    f"NonuniformTPConfig.non_active_ranks_per_dp: stage {stage} of key {key!r} is out of range; "
                    f"allowed: 0..{pp - 1} (pipeline_model_parallel_size={pp})"
                )
            return replica, stage
        if pp > 1:
            raise ValueError(
                f"NonuniformTPConfig.non_active_ranks_per_dp: key {key!r} names no pipeline stage; with "
                f"pipeline_model_parallel_size={pp} key the inactive slots by (replica, stage) "
                "(--ntp-failed-slots 'REPLICA,STAGE:SLOT[,SLOT...]')"
            )
        return key, 0

    @property
    def tp_reduced(self) -> int:
        """TP degree of a degraded replica."""
        return self.tp_base - self.tp_spares

    @property
    def failed_slots_by_stage(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """``(replica, stage)`` -> its inactive TP slots (with one stage, every stage is 0)."""
        return {(k, 0) if isinstance(k, int) else k: v for k, v in self.non_active_ranks_per_dp.items()}

    @property
    def degraded_replicas(self) -> list[int]:
        """The replicas that lost GPUs (in any stage), in index order."""
        return sorted({d for d, _ in self.failed_slots_by_stage})

    def _check_model_shape(self):
        degrees = sorted({self.tp_base, self.tp_reduced})
        checks = (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.num_query_groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.vocab_size),
        )
        for field, value in checks:
            if value is None:
                continue
            bad = [d for d in degrees if value % d]
            if bad:
                raise ValueError(
                    f"NonuniformTPConfig.{field}={value} cannot be split over TP degree(s) {bad}: it must "
                    f"be divisible by tp_base={self.tp_base} and tp_reduced={self.tp_reduced}; pick "
                    "tp_spares so both divide it (or pad the vocabulary to a common multiple)"
                )
        seq = self.seq_length
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"NonuniformTPConfig.sequence_parallel must be True or False, got {self.sequence_parallel!r}"
            )
        if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 1):
            raise ValueError(f"NonuniformTPConfig.seq_length (--seq-length) must be an int >= 1 or None, got {seq!r}")
        bad = [d for d in degrees if seq is not None and seq % d] if self.sequence_parallel else []
        if bad:
            common = math.lcm(*degrees)
            raise ValueError(
                f"NonuniformTPConfig.seq_length={seq} (--seq-length) cannot be split over TP degree(s) {bad} with "
                f"sequence_parallel (--sequence-parallel: each TP rank holds its part of the sequence): it must be "
                f"divisible by tp_base={self.tp_base} and tp_reduced={self.tp_reduced}, i.e. a multiple of {common} "
                f"(e.g. {-(-seq // common) * common}); or pick tp_spares (--ntp-spares) so both divide it"
            )

    def check_model(self, transformer_config, vocab_size: int | None = None, module=None) -> None:
        """Check a megatron ``TransformerConfig`` (and vocab) against both degrees, and
        ``module``'s parameters (when given) against what a degraded replica can hand its partner.

        Refused: parameters whose gradients Megatron's ``finalize_model_grads`` averages
        over the TP group (``average_gradients_across_tp_domain``: DSA indexers, HF
        wrappers): a degraded replica's ``tp_reduced`` per-rank gradients would join the
        partner's average over ``tp_base`` ranks, weighted wrongly. (Gradients it *sums*
        over TP, the q/k layer norms with ``qk_layernorm``, join exactly: degraded rank
        ``i``'s part goes to partner rank ``i``.) fp16 (a dynamic loss scale per replica)."""
        if getattr(transformer_config, "num_moe_experts", None):
            raise ValueError(
                f"nonuniform TP does not train MoE models (num_moe_experts={transformer_config.num_moe_experts}): "
                "the router's per-expert token counts and its load-balancing statistics are reduced over groups "
                "that differ between healthy and degraded replicas, so they would diverge; train this model "
                "without --ntp-tp-base"
            )
        if getattr(transformer_config, "fp16", False) and self.tp_spares:
            raise ValueError(
                "nonuniform TP does not train with fp16 (TransformerConfig.fp16=True, --fp16): a degraded replica's "
                "gradients join its partner's, and a dynamic loss scale would differ between them; use bf16 "
                "(--bf16) or fp32"
            )
        dataclasses.replace(
            self,
            num_attention_heads=transformer_config.num_attention_heads,
            num_query_groups=transformer_config.num_query_groups,
            ffn_hidden_size=transformer_config.ffn_hidden_size,
            vocab_size=vocab_size,
        )
        if module is None:
            return
        averaged = [
            name
            for name, p in module.named_parameters()
            if p.requires_grad and getattr(p, "average_gradients_across_tp_domain", False)
        ]
        if averaged and self.tp_spares:
            raise ValueError(
                f"nonuniform TP cannot train parameters whose gradients finalize_model_grads averages over the "
                f"TP group (average_gradients_across_tp_domain=True): {averaged[:3]}"
                f"{f' and {len(averaged) - 3} more' if len(averaged) > 3 else ''}; a degraded replica's tp_reduced "
                "per-rank gradients would join its partner's average over tp_base ranks with the wrong weight. Freeze "
                "them "
                "(requires_grad=False) or train this model without --ntp-tp-base"
            )

    @property
    def drops(self) -> bool:
        """Whether the replicas that lost GPUs leave the job (``policy="drop"``)."""
        return self.policy == "drop" and bool(self.non_active_ranks_per_dp)

    def kept_replicas(self, launched: int) -> int:
        """The replicas that train, of ``launched``: all, or the healthy ones when the others drop."""
        return launched - len(self.degraded_replicas) if self.drops else launched

    def replica_tp_degrees(self, num_replicas: int) -> list[int]:
        """TP degree of every replica that trains: ``tp_reduced`` for the listed ones, else ``tp_base``
        (all ``tp_base`` when the listed ones drop)."""
        if self.drops:
            return [self.tp_base] * num_replicas
        degraded = set(self.degraded_replicas)
        return [self.tp_reduced if d in degraded else self.tp_base for d in range(num_replicas)]

    def batch_shares(self, global_batch_size: int, micro_batch_size: int, num_replicas: int | None = None):
        """How many micro-batches of each global batch every replica processes,
        per :attr:`balance` (a :class:`megatron_ext.nonuniform_tp.balance.BatchShares`;
        logged once at INFO).

        ``num_replicas`` defaults to :attr:`data_parallel_size`, else to the job
        of the installed NTP process groups. Raises ValueError, saying which
        sizes work, when the global batch cannot be split that way."""
        from . import balance as balance_mod

        if num_replicas is None and self.data_parallel_size is not None:
            num_replicas = self.kept_replicas(self.data_parallel_size)
        if num_replicas is None:
            from .process_groups import get_ntp_process_groups

            groups = get_ntp_process_groups()
            if groups is None:
                raise ValueError(
                    "NonuniformTPConfig.batch_shares: the number of replicas is unknown; pass num_replicas, set "
                    "data_parallel_size (--ntp-data-parallel-size), or call it after "
                    "initialize_nonuniform_tp_process_groups()"
                )
            num_replicas = groups.layout.num_replicas
        shares = self._batch_shares(global_batch_size, micro_batch_size, num_replicas)
        balance_mod.logger.info("nonuniform TP (--ntp-balance %s) %s", self.balance, shares.describe())
        return shares

    def _batch_shares(self, global_batch_size, micro_batch_size, num_replicas):
        from . import balance as balance_mod

        if self.data_parallel_size is not None and num_replicas != self.kept_replicas(self.data_parallel_size):
            raise ValueError(
                f"num_replicas={num_replicas} differs from NonuniformTPConfig.data_parallel_size="
                f"{self.data_parallel_size}" + (" less the dropped replicas" if self.drops else "")
            )
        bad = [] if self.drops else [d for d in self.degraded_replicas if d >= num_replicas]
        if bad:
            raise ValueError(
                f"NonuniformTPConfig.non_active_ranks_per_dp names replica(s) {bad} but the job has "
                f"{num_replicas} replicas"
            )
        try:
            if self.balance == "none" or self.drops:  # dropped: the healthy replicas alone, alike
                return balance_mod.equal_batch_shares(num_replicas, global_batch_size, micro_batch_size)
            if self.balance == "shrink":
                degrees = self.replica_tp_degrees(num_replicas)
                pairs = pair_up(
                    [d for d, t in enumerate(degrees) if t < self.tp_base],
                    [d for d, t in enumerate(degrees) if t == self.tp_base],
                )
                pair = set(pairs) | set(pairs.values())
                return balance_mod.shrunk_batch_shares(
                    degrees,
                    global_batch_size,
                    micro_batch_size,
                    self.max_shrink,
                    unit=self.share_unit,
                    overheads=[TRANSFER_FRACTION if d in pair else 0.0 for d in range(num_replicas)],
                )
            # measured: the shares by TP degree until the throughputs are measured (the best split even
            # where it is no faster than equal shares: the measured one replaces it)
            return balance_mod.balanced_batch_shares(
                self.replica_tp_degrees(num_replicas),
                global_batch_size,
                micro_batch_size,
                what="TP degrees",
                require_gain=self.balance == "tp",
                unit=self.share_unit,
                pipeline_stages=self.pipeline_model_parallel_size,  # each replica's 1F1B bubble counted
            )
        except ValueError as exc:
            raise ValueError(
                f"NonuniformTPConfig.balance={self.balance!r} (--ntp-balance {self.balance}): {exc}"
            ) from None

    def layout(self, world_size: int):
        """The rank layout of this job for ``world_size`` processes."""
        return NTPLayout.from_config(self, world_size)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "NonuniformTPConfig | None":
        """Build from :func:`add_nonuniform_tp_args` flags; ``None`` when NTP is off.

        The other ``--ntp-*`` flags without ``--ntp-tp-base`` are refused (they would
        otherwise be ignored, leaving NTP off)."""
        tp_base = getattr(args, "ntp_tp_base", None)
        failed_text = getattr(args, "ntp_failed_slots", None) or ""
        spares = getattr(args, "ntp_spares", None)
        data_parallel_size = getattr(args, "ntp_data_parallel_size", None)
        launch_mode = getattr(args, "ntp_launch_mode", "packed")
        balance = getattr(args, "ntp_balance", "none")
        measure_steps = getattr(args, "ntp_balance_measure_steps", None)
        chunk = getattr(args, "ntp_transfer_chunk_mb", None)
        policy = getattr(args, "ntp_policy", "auto")
        max_shrink = getattr(args, "ntp_max_shrink", None)
        share_unit = getattr(args, "ntp_share_unit", "microbatch")
        # Megatron's --sequence-parallel and --seq-length, where the parser has them
        sequence_parallel = getattr(args, "sequence_parallel", False) is True
        seq_length = getattr(args, "seq_length", None)
        seq_length = seq_length if isinstance(seq_length, int) and seq_length > 0 else None
        pp = getattr(args, "pipeline_model_parallel_size", None)
        pp = pp if isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 else 1
        if tp_base is None:
            given = [
                f"{flag} {value!r}"
                for flag, value, unset in (
                    ("--ntp-failed-slots", failed_text, ""),
                    ("--ntp-spares", spares, None),
                    ("--ntp-data-parallel-size", data_parallel_size, None),
                    ("--ntp-launch-mode", launch_mode, "packed"),
                    ("--ntp-balance", balance, "none"),
                    ("--ntp-balance-measure-steps", measure_steps, None),
                    ("--ntp-transfer-chunk-mb", chunk, None),
                    ("--ntp-policy", policy, "auto"),
                    ("--ntp-max-shrink", max_shrink, None),
                    ("--ntp-share-unit", share_unit, "microbatch"),
                )
                if value != unset
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} given without --ntp-tp-base, which turns NTP on: "
                    "--ntp-failed-slots, --ntp-spares and the other --ntp-* flags need --ntp-tp-base N "
                    "(an int >= 1, the TP degree of a healthy replica); pass --ntp-tp-base or drop them"
                )
            return None
        failed = parse_failed_slots(
            failed_text,
            tp_base=tp_base if isinstance(tp_base, int) and tp_base >= 1 else None,
            data_parallel_size=(
                data_parallel_size if isinstance(data_parallel_size, int) and data_parallel_size >= 1 else None
            ),
            pipeline_model_parallel_size=pp,
        )
        vpp = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
        if failed and isinstance(vpp, int) and not isinstance(vpp, bool):
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {vpp} with --ntp-failed-slots: nonuniform TP does not run "
                "interleaved pipeline schedules in a job with a degraded replica (a degraded replica and its partner "
                "run different numbers of micro-batches, and the interleaved schedule then reaches the model chunks' "
                "transfers in different orders on the two); drop --num-layers-per-virtual-pipeline-stage"
            )
        if measure_steps is not None and balance != "measured":
            raise ValueError(
                f"--ntp-balance-measure-steps {measure_steps} is read only with --ntp-balance measured (got "
                f"--ntp-balance {balance}): drop it or pass --ntp-balance measured"
            )
        if max_shrink is not None and balance != "shrink":
            raise ValueError(
                f"--ntp-max-shrink {max_shrink} is read only with --ntp-balance shrink (got --ntp-balance "
                f"{balance}): drop it or pass --ntp-balance shrink"
            )
        if share_unit != "microbatch" and balance == "none":
            raise ValueError(
                f"--ntp-share-unit {share_unit} is read only with --ntp-balance tp, measured or shrink (got "
                "--ntp-balance none: equal shares are whole micro-batches): drop it or pass one of those"
            )
        if share_unit == "sample" and getattr(args, "calculate_per_token_loss", None) is False:
            raise ValueError(
                "--ntp-share-unit sample needs --calculate-per-token-loss: a replica's last micro-batch may be "
                "partial, and Megatron's forward-backward function divides every micro-batch's loss by the number "
                "of micro-batches, which weighs a partial one's samples more; pass --calculate-per-token-loss or "
                "--ntp-share-unit microbatch"
            )
        if spares is None:
            # the largest reduced degree the model (Megatron's flags, where the parser has them) splits at
            gqa = getattr(args, "group_query_attention", False)
            sizes = {
                "num_attention_heads": getattr(args, "num_attention_heads", None),
                "num_query_groups": getattr(args, "num_query_groups", None) if gqa else None,
                "ffn_hidden_size": getattr(args, "ffn_hidden_size", None),
                "seq_length": seq_length if sequence_parallel else None,
            }
            sizes = {k: v for k, v in sizes.items() if isinstance(v, int) and v > 0}
            spares, failed = compute_uniform_tp_spares_with_parity(
                failed, tp_base, divides=sizes, pipeline_model_parallel_size=pp
            )
        extra = {} if measure_steps is None else {"balance_measure_steps": measure_steps}
        if chunk is not None:
            extra["transfer_chunk_mb"] = chunk
        if max_shrink is not None:
            extra["max_shrink"] = max_shrink
        if share_unit != "microbatch":
            extra["share_unit"] = share_unit
        if sequence_parallel:
            extra.update(sequence_parallel=True, seq_length=seq_length)
        if pp > 1:
            extra["pipeline_model_parallel_size"] = pp
        config = cls(
            tp_base=tp_base,
            tp_spares=spares,
            non_active_ranks_per_dp=failed,
            data_parallel_size=data_parallel_size,
            launch_mode=launch_mode,
            balance=balance,
            policy=policy,
            **extra,
        )
        # Megatron's --global-batch-size / --micro-batch-size (and its world size): the policy's prediction,
        # and a global batch that the replicas cannot share as --ntp-balance asks refused before anything is built.
        sizes = [getattr(args, name, None) for name in ("global_batch_size", "micro_batch_size")]
        world_size = getattr(args, "world_size", None)
        replicas = data_parallel_size
        if replicas is None and isinstance(world_size, int):
            replicas = config.layout(world_size).num_replicas
        known = all(isinstance(v, int) for v in sizes) and replicas is not None
        if known and config.balance != "none" and config.policy != "drop":
            # the shares --ntp-balance asks for, where the degraded replicas train
            dataclasses.replace(config, policy="degrade")._batch_shares(*sizes, replicas)
        if config.policy == "auto" and replicas is not None:
            config = dataclasses.replace(config, policy=decide(config, replicas, *sizes).choice)
        if known and config.drops:
            config._batch_shares(*sizes, config.kept_replicas(replicas))  # the healthy replicas' equal split
        return config


def compute_uniform_tp_spares_with_parity(
    faulty_gpu_map: Mapping,
    tp_base: int,
    divides: Mapping[str, int | None] | None = None,
    pipeline_model_parallel_size: int = 1,
) -> tuple[int, dict]:
    """Spares and per-replica non-active slots so every degraded replica runs
    at the same reduced TP degree, in every pipeline stage.

    ``faulty_gpu_map`` keys are replica indices (one stage) or ``(replica, stage)`` pairs.
    ``tp_spares`` is the largest failure count over replicas and stages, raised until
    ``tp_base - tp_spares`` divides every size in ``divides`` (e.g. ``{"num_attention_heads":
    32, "num_query_groups": 8, "ffn_hidden_size": 14336}``; ``None`` values are skipped): the
    largest reduced degree the model splits at (1 always does). A replica (stage) with fewer
    failures also deactivates its highest healthy slots; with pipeline stages, every stage of a
    replica that lost GPUs in any stage is listed. Returns ``(tp_spares, non_active_ranks_per_dp)``
    keyed like ``NonuniformTPConfig.non_active_ranks_per_dp`` (by replica with one stage, else by
    ``(replica, stage)``).
    """
    if not isinstance(tp_base, int) or tp_base < 1:
        raise ValueError(f"tp_base must be an int >= 1, got {tp_base!r}")
    pp = pipeline_model_parallel_size
    faulty = {}
    for key, slots in faulty_gpu_map.items():
        replica, stage = key if isinstance(key, tuple) else (key, 0)
        if not 0 <= stage < pp:
            raise ValueError(
                f"faulty_gpu_map[{key!r}]: stage {stage} out of range; allowed: 0..{pp - 1} "
                f"(pipeline_model_parallel_size={pp})"
            )
        slots = sorted(set(slots))
        bad = [s for s in slots if not 0 <= s < tp_base]
        if bad:
            raise ValueError(f"faulty_gpu_map[{key!r}]: slot(s) {bad} out of range; allowed: 0..{tp_base - 1}")
        if slots:
            faulty[(replica, stage)] = slots
    if not faulty:
        return 0, {}
    spares = max(len(s) for s in faulty.values())
    if spares >= tp_base:
        raise ValueError(
            f"a replica lost {spares} of {tp_base} GPUs"
            + (" of one pipeline stage" if pp > 1 else "")
            + ": at least one GPU per replica"
            + (" and stage" if pp > 1 else "")
            + " must survive (drop that replica from the job instead)"
        )
    sizes = [v for v in (divides or {}).values() if v is not None]
    lost = spares
    spares = tp_base - reduced_degree(tp_base, [len(s) for s in faulty.values()], sizes)
    if spares > lost:
        logger.info(
            "nonuniform TP: a replica lost %d of %d GPUs; degraded replicas run at TP %d, the largest degree below "
            "%d that divides %s",
            lost,
            tp_base,
            tp_base - spares,
            tp_base - lost + 1,
            ", ".join(f"{k}={v}" for k, v in divides.items() if v is not None),
        )
    out = {}
    for replica in sorted({d for d, _ in faulty}):
        for stage in range(pp):
            slots = faulty.get((replica, stage), [])
            extra = [s for s in reversed(range(tp_base)) if s not in slots][: spares - len(slots)]
            out[replica if pp == 1 else (replica, stage)] = tuple(sorted(slots + extra))
    return spares, out


FAILED_SLOTS_FORM = (
    "'REPLICA[,STAGE]:SLOT[,SLOT...]' entries separated by ';' (REPLICA >= 0, STAGE: the pipeline stage, "
    "needed with --pipeline-model-parallel-size > 1, SLOT in 0..tp_base-1, each listed once), e.g. '0:3;2:1,5' "
    "or '0,1:3'"
)


def parse_failed_slots(
    text: str,
    tp_base: int | None = None,
    data_parallel_size: int | None = None,
    pipeline_model_parallel_size: int | None = None,
) -> dict:
    """``"0:3;2:1,5"`` -> ``{0: (3,), 2: (1, 5)}``; ``"0,1:3"`` -> ``{(0, 1): (3,)}`` (replica 0,
    pipeline stage 1).

    Refused, with a ValueError naming ``--ntp-failed-slots``: an entry not of the
    form ``REPLICA[,STAGE]:SLOT[,SLOT...]``, a negative replica index, stage or slot, a
    replica (stage) listed twice or with no slot, a slot listed twice for one entry; with
    ``tp_base`` also a slot ``>= tp_base``, with ``data_parallel_size`` also a replica index
    ``>= data_parallel_size``, with ``pipeline_model_parallel_size`` also a stage out of range,
    and an entry without a stage where there are several stages.
    """
    out: dict = {}
    pp = pipeline_model_parallel_size
    parts = [p.strip() for p in text.split(";")] if text.strip() else []
    if "" in parts:
        raise ValueError(
            f"--ntp-failed-slots: empty entry in {text!r} (';' twice, or at an end); expected {FAILED_SLOTS_FORM}"
        )
    for part in parts:
        head, sep, slots = part.partition(":")
        try:
            if not sep:
                raise ValueError
            coords = tuple(int(c) for c in head.split(","))
            if len(coords) not in (1, 2):
                raise ValueError
            vals = tuple(int(s) for s in slots.split(",") if s.strip())
        except ValueError:
            raise ValueError(f"--ntp-failed-slots: cannot parse {part!r}; expected {FAILED_SLOTS_FORM}") from None
        key = coords[0]
        if key < 0 or (data_parallel_size is not None and key >= data_parallel_size):
            allowed = (
                "REPLICA >= 0"
                if data_parallel_size is None
                else f"0..{data_parallel_size - 1} (--ntp-data-parallel-size {data_parallel_size})"
            )
            raise ValueError(f"--ntp-failed-slots: replica index {key} in {part!r} is out of range; allowed: {allowed}")
        if len(coords) == 2:
            stage = coords[1]
            if stage < 0 or (pp is not None and stage >= pp):
                allowed = "STAGE >= 0" if pp is None else f"0..{pp - 1} (--pipeline-model-parallel-size {pp})"
                raise ValueError(f"--ntp-failed-slots: stage {stage} in {part!r} is out of range; allowed: {allowed}")
            key = (key, stage)
        elif pp is not None and pp > 1:
            raise ValueError(
                f"--ntp-failed-slots: {part!r} names no pipeline stage; with --pipeline-model-parallel-size {pp} "
                f"write REPLICA,STAGE:SLOTS (e.g. '{key},0:{slots.strip()}')"
            )
        if key in out:
            raise ValueError(f"--ntp-failed-slots: {_entry(key)} listed twice in {text!r}")
        if not vals:
            raise ValueError(
                f"--ntp-failed-slots: {_entry(key)} lists no slot in {part!r}; expected {FAILED_SLOTS_FORM} "
                "(leave healthy replicas out)"
            )
        for s in vals:
            if s < 0 or (tp_base is not None and s >= tp_base):
                allowed = "SLOT >= 0" if tp_base is None else f"0..{tp_base - 1} (--ntp-tp-base {tp_base})"
                raise ValueError(f"--ntp-failed-slots: slot {s} of {_entry(key)} is out of range; allowed: {allowed}")
        dup = sorted({s for s in vals if vals.count(s) > 1})
        if dup:
            raise ValueError(
                f"--ntp-failed-slots: slot {dup[0]} listed twice for {_entry(key)} in {part!r}; "
                "list each failed TP slot once"
            )
        out[key] = vals
    if pp == 1:  # 'R,0' is replica R's one stage
        out = {k[0] if isinstance(k, tuple) else k: v for k, v in out.items()}
    return out


def _entry(key) -> str:
    return f"replica {key[0]} stage {key[1]}" if isinstance(key, tuple) else f"replica {key}"


def format_failed_slots(slots: Mapping) -> str:
    """Inverse of :func:`parse_failed_slots` (replicas with no slot, i.e. healthy ones, are left out)."""

    def head(key):
        return ",".join(map(str, key)) if isinstance(key, tuple) else str(key)

    return ";".join(f"{head(k)}:{','.join(map(str, s))}" for k, s in sorted(slots.items()) if s)


def _failed_slots_arg(text: str) -> str:
    """argparse ``type`` of ``--ntp-failed-slots``: the text, checked by :func:`parse_failed_slots`
    (argparse prefixes the message with the flag)."""
    try:
        parse_failed_slots(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--ntp-failed-slots: ")) from None
    return text


class _FailedSlotsAction(argparse.Action):
    """``--ntp-failed-slots`` takes ``nargs="?"`` so that a value argparse reads as
    an option (``-1:1`` starts with ``-``) arrives here as a missing value and is
    refused with the allowed form, not argparse's bare "expected one argument"."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            raise argparse.ArgumentError(
                self,
                f"expected a value {FAILED_SLOTS_FORM}; got none (a value that starts with '-', like "
                "'-1:1', is read as another option; replica indices and slots are >= 0)",
            )
        setattr(namespace, self.dest, values)


def add_nonuniform_tp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--ntp-*`` flags to a Megatron training script's parser."""
    group = parser.add_argument_group("nonuniform tensor parallelism (megatron_ext)")
    group.add_argument("--ntp-tp-base", type=int, default=None, help="TP degree of a healthy replica; enables NTP.")
    group.add_argument(
        "--ntp-spares",
        type=int,
        default=None,
        help="TP slots each degraded replica gives up; default: derived from --ntp-failed-slots with spare parity.",
    )
    group.add_argument(
        "--ntp-failed-slots",
        type=_failed_slots_arg,
        default="",
        nargs="?",
        action=_FailedSlotsAction,
        metavar="REPLICA:SLOTS",
        help="Failed TP slots per replica: 'REPLICA:SLOT[,SLOT...]' entries separated "
        "by ';' (REPLICA >= 0, SLOT in 0..tp_base-1, each listed once), e.g. "
        "'0:3;2:1,5'. Needs --ntp-tp-base.",
    )
    group.add_argument(
        "--ntp-data-parallel-size",
        type=int,
        default=None,
        help="Number of replicas; default: derived from the world size.",
    )
    group.add_argument(
        "--ntp-launch-mode",
        choices=LAUNCH_MODES,
        default="packed",
        help="packed: only healthy GPUs have processes; simulate: every slot has one "
        "and the non-active ones leave (tests).",
    )
    group.add_argument(
        "--ntp-balance",
        choices=BALANCE_MODES,
        default="none",
        help="Share of each global batch per replica: none: equal (Megatron's); tp: micro-batches "
        "in proportion to each replica's TP degree (a degraded replica is no straggler); "
        "measured: tp for the first --ntp-balance-measure-steps steps, then in proportion to each "
        "replica's measured throughput; shrink: every replica keeps its per-step work (healthy replicas "
        "their equal share, a degraded one what it computes in that time) and the global batch shrinks by "
        "the shortfall, at most --ntp-max-shrink of it. Needs --ntp-tp-base.",
    )
    group.add_argument(
        "--ntp-balance-measure-steps",
        type=int,
        default=None,
        metavar="N",
        help="With --ntp-balance measured: steps timed (per replica, the median) before the shares "
        "change (default 5, >= 1).",
    )
    group.add_argument(
        "--ntp-max-shrink",
        type=float,
        default=None,
        metavar="FRACTION",
        help="With --ntp-balance shrink: the largest fraction of the global batch left out per step "
        "(default 0.05, in [0, 1)); beyond it the degraded replicas take more and the step grows.",
    )
    group.add_argument(
        "--ntp-share-unit",
        choices=SHARE_UNITS,
        default="microbatch",
        help="What the unequal shares of --ntp-balance tp|measured|shrink count: microbatch (whole "
        "micro-batches, default) or sample (samples: finer, a replica's last micro-batch may be partial; "
        "needs --calculate-per-token-loss).",
    )
    group.add_argument(
        "--ntp-transfer-chunk-mb",
        type=float,
        default=None,
        metavar="MB",
        help="Largest unit (MiB of fp32 gradient per exchange; larger tensors are cut) in which a degraded "
        "replica's gradients go to its healthy partner and the parameters come back: each rank's transfer "
        "staging is at most this per dtype (default 64, > 0).",
    )
    group.add_argument(
        "--ntp-policy",
        choices=POLICIES,
        default="auto",
        help="What the replicas that lost GPUs do: degrade: train at the reduced TP degree, each the "
        "satellite of a healthy partner; drop: leave the job (the healthy replicas share the global batch); "
        "auto (default): the faster of the two as the cost model predicts it from the failure map, "
        "--ntp-balance and Megatron's --global-batch-size / --micro-batch-size (one INFO line with both "
        "predictions).",
    )
    return parser
