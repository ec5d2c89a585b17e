"""The one refit configuration (:class:`RefitConfig`) and its ``--refit-*`` flags.

One dataclass describes every refit: where the weights go (``transport``),
when (``every_n_steps``), how they move (bucket size, backend, timeout, finite
check). ``transport`` picks the destination's form:

- ``inprocess``, ``broadcast``, ``ipc``, ``ipc-push``, ``ipc-direct``: the
  export hook (:class:`~.exporter.WeightExporter`): every engine receives whole
  Hugging Face tensors at ``target`` (engines run :func:`~.transports.serve.serve`).
- ``p2p``: the reshard refit: point-to-point from the owning trainer ranks to
  each engine rank's own shards of an ``engine_tp`` x ``engine_dp`` (``engine_ep``)
  layout, inside this job or, with ``store``, across jobs
  (:class:`~.exec.reshard.ReshardExecutor`, :class:`~.refit.TrainerRefit`).

Fields that only one form reads are refused with the other, so a flag is never
silently ignored. The flags of earlier releases keep working as aliases:
``--weight-export-X`` is ``--refit-X``; ``--reshard-refit-X`` is ``--refit-X`` and
selects ``--refit-transport p2p``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from .control.channel import PORTS, _host_port, parse_address
from .plan.budget import ATOMIC_STAGING

__all__ = ["TRANSPORTS", "RefitConfig", "add_refit_args", "parse_address"]

HOOK_TRANSPORTS = ("inprocess", "broadcast", "ipc", "ipc-push", "ipc-direct")
TRANSPORTS = (*HOOK_TRANSPORTS, "p2p")
BACKENDS = ("auto", "gloo", "nccl")
QUANTIZE = ("none", "fp8-block")  # what a refit sends: the model's dtype, or block-scaled FP8 (sharding.fp8)
IN_PLACE = ("ipc-push", "ipc-direct")  # hook transports that write the engine's own tensors (no export buckets)
MIN_BUCKET_MB, MAX_BUCKET_MB = 16, 1024  # the export hook's automatic size (5% of free memory) stays in this range
P2P_BUCKET_MB = 64  # the p2p refit's default staging bucket per peer
# --refit-memory-budget-mb auto: measured on 4xH200 (refit_vs_swap.py, 3.6B dense and MoE, 2026-11-27): streaming
# within 512 MiB is 1.15-2.29x megatron-core's swap_model_weights (1.5x or more in 8 of 10 layouts) where unbounded
# staging took 1.0-6.1 GiB per rank; see docs/weight_export_reshard.md
AUTO_MEMORY_BUDGET_MB = 512
BUDGET_KEYWORDS = ("auto", "none")
BUDGET_WORDS = (
    f"'auto' ({AUTO_MEMORY_BUDGET_MB} MiB, the version of an atomic receiver on the device on top), "
    "'none' / None (no bound)"
)


def memory_budget(text: str) -> float | str:
    """``--refit-memory-budget-mb``: ``auto``, ``none`` or a number of MiB (checked by :class:`RefitConfig`)."""
    if text.lower() in BUDGET_KEYWORDS:
        return text.lower()
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto, none or a number of MiB, got {text!r}") from None


# The smallest bucket_size_mb accepted: one 4 KiB page. Below it the size means
# nothing: an export bucket (plan.build_plan) rounds every tensor up to
# wire.ALIGN = 256 bytes, so a smaller bucket holds no tensor and each one gets
# an oversized bucket of its own; a p2p bucket (wire.bucketize) starts with a
# 32-byte header padded to wire.ALIGN and cuts transfers into rows of at most
# bucket_bytes - 256 bytes, so a tiny bucket moves a few bytes per message (and at
# 1e-9 MiB, int(bucket_size_mb * 2**20) is 0). And a bucket under a page saves no
# memory: the ipc transports share their buffers as CUDA allocations of whole segments.
MIN_BUCKET_BYTES = 4096
# Fields read by one form only (default values are what the other form gets).
P2P_ONLY = (
    "store",
    "engine_tp",
    "engine_dp",
    "engine_ep",
    "vocab_padding",
    "max_inflight",
    "atomic",
    "atomic_staging",
    "memory_budget_mb",
    "zero_copy_mb",
)
HOOK_ONLY = ("target", "vocab_size")


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass
class RefitConfig:
    """How and when the trainer refits inference engines (see the module docstring for the two forms).

    Destination: ``transport``; ``target``, the engines' endpoints
    ``"host:port[,host:port...]"`` (hook transports other than ``inprocess``);
    ``store``, ``"host:port"`` of the :class:`~.control.refit_group.RefitGroup` when a p2p
    engine is a separate job (None: its ranks are in this job); the p2p engine's
    layout ``engine_tp`` x ``engine_dp`` ranks, experts split over ``engine_ep`` of
    them (1: TP-sharded), vocabulary padded to ``vocab_padding`` rows;
    ``vocab_size``: the hook's HF vocabulary (Megatron's padded rows beyond it are
    not exported). Bytes: ``bucket_size_mb`` (None: the hook sizes it from free
    device memory, 5% within 16..1024 MiB; p2p uses 64 MiB per peer),
    ``max_inflight`` p2p rounds in flight, ``atomic`` (p2p: stage the whole
    version and apply it at the end, else stream; a hook engine chooses with
    ``serve(atomic=)``), ``atomic_staging`` (p2p atomic receivers keep the version on
    the ``device`` or in pinned ``host`` memory), ``memory_budget_mb`` (p2p: the most
    device staging any rank may hold, whatever its number of peers; ``"auto"`` (default):
    :data:`AUTO_MEMORY_BUDGET_MB`, an atomic receiver's version on the device on top; ``"none"`` /
    None: no bound, ``max_inflight`` buckets per peer each way), ``zero_copy_mb`` (p2p: contiguous runs of
    at least this many MiB go from the sender's tensor into a streaming receiver's without staging, see
    :class:`~.exec.reshard.ReshardExecutor`'s ``zero_copy_bytes``; None (default): every byte staged),
    ``check_finite`` (refuse to publish a version with a NaN or Inf weight, checked inside the copies that
    move the bytes), ``backend``
    (of the broadcast group or the refit group; auto: NCCL on GPU) and
    ``timeout_s`` (every wait on a peer). ``quantize``: ``fp8-block`` sends
    decoder-layer linear weights as FP8 with a float32 scale per 128 x 128 block
    (:func:`~megatron_ext.sharding.fp8_layout`; the hook quantizes whole tensors
    after its gather), about half the bytes; not with ``ipc-push`` / ``ipc-direct``,
    which write the engine's tensors in the model's dtype. When:
    ``every_n_steps`` (0: only when called; :meth:`due`).
    """

    transport: str = "inprocess"
    target: str | None = None
    store: str | None = None
    engine_tp: int = 1
    engine_dp: int = 1
    engine_ep: int = 1
    vocab_padding: int = 64
    vocab_size: int | None = None
    bucket_size_mb: float | None = None
    max_inflight: int = 2
    atomic: bool = True
    atomic_staging: str = "device"
    memory_budget_mb: float | str | None = "auto"
    zero_copy_mb: float | None = None
    check_finite: bool = True
    every_n_steps: int = 0
    backend: str = "auto"
    timeout_s: float = 120.0
    quantize: str = "none"

    def __post_init__(self):
        def refuse(field, allowed):
            value = getattr(self, field)
            raise ValueError(
                f"RefitConfig.{field} (--refit-{field.replace('_', '-')}) must be {allowed}, got {value!r}"
            )

        if self.transport not in TRANSPORTS:
            refuse("transport", f"one of {TRANSPORTS}")
        if self.backend not in BACKENDS:
            refuse("backend", f"one of {BACKENDS}")
        if self.quantize not in QUANTIZE:
            refuse("quantize", f"one of {QUANTIZE}")
        if self.atomic_staging not in ATOMIC_STAGING:
            refuse("atomic_staging", f"one of {ATOMIC_STAGING}")
        unused = HOOK_ONLY if self.p2p else P2P_ONLY
        for field in unused:
            if getattr(self, field) != RefitConfig.__dataclass_fields__[field].default:
                form = "the export hook's transports" if field in HOOK_ONLY else "transport='p2p' (the reshard refit)"
                raise ValueError(
                    f"RefitConfig.{field} (--refit-{field.replace('_', '-')}) is read by {form} only; "
                    f"transport={self.transport!r} would ignore it: drop it or change the transport"
                )
        for name in ("engine_tp", "engine_dp", "engine_ep", "vocab_padding", "max_inflight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                refuse(name, "an integer >= 1")
        if (self.engine_tp * self.engine_dp) % self.engine_ep:
            refuse("engine_ep", f"a divisor of engine_tp * engine_dp = {self.engine_tp * self.engine_dp}")
        if self.transport not in ("inprocess", "p2p") and not self.target:
            raise ValueError(
                f"RefitConfig.target (--refit-target) is required for transport={self.transport!r}: the "
                "engines' receiver endpoints as 'host:port[,host:port...]'"
            )
        if self.target:
            bad = [a for a in self.targets if _host_port(a) is None]
            if bad or not self.targets:
                which = f" ({bad[0]!r} is not)" if bad else ""
                refuse("target", f"'host:port[,host:port...]' with every port in {PORTS[0]}..{PORTS[1]}{which}")
        if self.quantize != "none" and self.transport in IN_PLACE:
            refuse(
                "quantize",
                f"'none' with transport={self.transport!r}, which writes the engine's tensors in the model's "
                "dtype (for FP8 use transport='ipc', 'broadcast' or 'inprocess' (buckets of FP8 weights and "
                "scales) or 'p2p')",
            )
        if self.transport == "ipc-push" and len(self.targets) != 1:
            raise ValueError(
                f"RefitConfig.transport='ipc-push' writes into one engine's weights; got {len(self.targets)} "
                f"targets in target={self.target!r} (use transport='ipc' or 'broadcast' for several engines)"
            )
        if self.store is not None and _host_port(self.store) is None:
            refuse("store", f"'host:port' with a port in {PORTS[0]}..{PORTS[1]} (the refit group's store)")
        smallest = MIN_BUCKET_BYTES / (1 << 20)  # MiB
        fields = (
            ("bucket_size_mb", "None (automatic)"),
            ("memory_budget_mb", BUDGET_WORDS),
            ("zero_copy_mb", "None (off: every byte staged)"),
        )
        for field, unset in fields:
            mib = getattr(self, field)
            if field == "memory_budget_mb" and mib in BUDGET_KEYWORDS:
                continue
            if mib is not None and not (_finite_number(mib) and mib * (1 << 20) >= MIN_BUCKET_BYTES):
                page = ", one page" if field == "bucket_size_mb" else ""
                refuse(field, f"{unset} or a finite number of MiB >= {smallest:g} (4 KiB{page})")
        if self.atomic_staging == "host" and not self.atomic:
            raise ValueError(
                "RefitConfig.atomic_staging='host' (--refit-atomic-staging host) is where an atomic refit keeps the "
                "version; with atomic=False (--no-refit-atomic) every round is written as it arrives: drop one"
            )
        if not isinstance(self.every_n_steps, int) or self.every_n_steps < 0:
            refuse("every_n_steps", "an integer >= 0 (0: refit only when called)")
        if not (_finite_number(self.timeout_s) and self.timeout_s > 0):
            refuse("timeout_s", "> 0 and finite (seconds)")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size <= 0):
            refuse("vocab_size", "None or an integer > 0")

    @property
    def p2p(self) -> bool:
        return self.transport == "p2p"

    @property
    def targets(self) -> list[str]:
        return [a.strip() for a in (self.target or "").split(",") if a.strip()]

    @property
    def bucket_bytes(self) -> int | None:
        """The bucket size in bytes; None: the export hook sizes it from free memory."""
        if self.bucket_size_mb is None:
            return P2P_BUCKET_MB << 20 if self.p2p else None
        return int(self.bucket_size_mb * (1 << 20))

    @property
    def executor_kwargs(self) -> dict:
        """Keyword arguments of ``ReshardExecutor`` / ``FanoutRefit`` / ``TrainerRefit`` / ``EngineRefit``."""
        return dict(
            bucket_bytes=self.bucket_bytes,
            max_inflight=self.max_inflight,
            atomic=self.atomic,
            check_finite=self.check_finite,
            memory_budget_bytes=self.memory_budget_bytes,
            memory_budget_strict=self.memory_budget_mb != "auto",
            atomic_staging=self.atomic_staging,
            zero_copy_bytes=None if self.zero_copy_mb is None else int(self.zero_copy_mb * (1 << 20)),
        )

    @property
    def memory_budget_bytes(self) -> int | None:
        """The p2p staging budget in bytes: ``"auto"`` is :data:`AUTO_MEMORY_BUDGET_MB`; None / ``"none"``: no bound."""
        mib = self.memory_budget_mb
        if mib in (None, "none"):
            return None
        return int((AUTO_MEMORY_BUDGET_MB if mib == "auto" else mib) * (1 << 20))

    @property
    def store_address(self) -> tuple[str, int] | None:
        return None if self.store is None else _host_port(self.store)

    def resolved_backend(self, device) -> str:
        """``backend`` with ``auto`` decided for ``device`` (NCCL on CUDA, gloo elsewhere)."""
        if self.backend != "auto":
            return self.backend
        import torch

        return "nccl" if torch.device(device).type == "cuda" else "gloo"

    def engine_layout(self, specs, ranks=None):
        """The p2p engine's :func:`~.plan.layout.inference_layout` on ``ranks`` (default ``0..tp*dp-1``)."""
        from .plan.layout import inference_layout

        return inference_layout(
            specs,
            tp=self.engine_tp,
            dp=self.engine_dp,
            ep=self.engine_ep,
            ranks=ranks,
            vocab_padding=self.vocab_padding,
        )

    def wire_layout(self, layout):
        """``layout`` as the p2p refit sends it: block-scaled FP8 with ``quantize='fp8-block'``."""
        from ..sharding.fp8 import fp8_layout

        return fp8_layout(layout) if self.quantize == "fp8-block" else layout

    def join(self, rank: int, world_size: int, *, device=None):
        """Join the :class:`~.control.refit_group.RefitGroup` at ``store`` as refit rank ``rank`` of
        ``world_size`` (trainer ranks first, then the engine's), with this config's backend and timeout."""
        import torch

        from .control.refit_group import RefitGroup

        if self.store_address is None:
            raise ValueError(
                "RefitConfig.store is not set: pass --refit-store host:port (refit rank 0's address) "
                "when the engine runs as a separate job"
            )
        cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        host, port = self.store_address
        return RefitGroup.join(
            host,
            port,
            rank,
            world_size,
            backend=self.resolved_backend("cuda" if cuda else "cpu"),
            device=device,
            timeout_s=self.timeout_s,
        )

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) ends with a refit."""
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RefitConfig":
        """The config of :func:`add_refit_args`' flags. A ``--reshard-refit-*`` alias selects
        ``transport='p2p'``; with another ``--refit-transport`` it is refused."""
        values = {f.name: getattr(args, "refit_" + f.name) for f in dataclasses.fields(cls)}
        aliases = getattr(args, _P2P_ALIASES, [])
        if aliases and values["transport"] not in (None, "p2p"):
            raise ValueError(
                f"{aliases[0]} is a flag of the reshard refit (--refit-transport p2p), but the transport is "
                f"{values['transport']!r}: drop one of them"
            )
        if values["transport"] is None:
            values["transport"] = "p2p" if aliases else cls.transport
        return cls(**values)


_P2P_ALIASES = "refit_p2p_aliases"  # the --reshard-refit-* flags given, in order


def _p2p_alias(base):
    class Alias(base):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            setattr(namespace, _P2P_ALIASES, [*getattr(namespace, _P2P_ALIASES, []), option_string])

    return Alias


_P2P_STORE, _P2P_BOOL = _p2p_alias(argparse._StoreAction), _p2p_alias(argparse.BooleanOptionalAction)


def add_refit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--refit-*`` flags with their aliases ``--weight-export-*`` and ``--reshard-refit-*``
    (a Megatron ``extra_args_provider`` works too). Adding them twice is a no-op."""
    if any("--refit-transport" in a.option_strings for a in parser._actions):
        return parser
    d = RefitConfig
    g = parser.add_argument_group("refit", "stream weights to inference engines (megatron_ext)")

    def flag(name, *, hook=True, p2p=True, boolean=False, **kw):
        names = [f"--refit-{name}"] + ([f"--weight-export-{name}"] if hook else [])
        dest = "refit_" + name.replace("-", "_")
        default = getattr(d, dest.removeprefix("refit_"))
        if boolean:
            g.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=default, **kw)
        else:
            g.add_argument(*names, dest=dest, default=default, **kw)
        if p2p:  # the alias of the reshard refit's flags; it selects transport p2p
            action = _P2P_BOOL if boolean else _P2P_STORE
            g.add_argument(
                f"--reshard-refit-{name}",
                dest=dest,
                action=action,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
                **{k: v for k, v in kw.items() if k != "help"},
            )

    g.add_argument(
        "--refit-transport",
        "--weight-export-transport",
        dest="refit_transport",
        choices=TRANSPORTS,
        default=None,
        help="inprocess (default); broadcast (NCCL/gloo to engines on other GPUs); ipc (engine on the same GPU, "
        "two shared buffers); ipc-push (one engine on the same GPU, written in place: one target); ipc-direct "
        "(same GPU, TP=PP=1, engine copies from the weights); p2p (the reshard refit: each engine rank gets its "
        "own shards; implied by any --reshard-refit-* flag)",
    )
    flag("target", p2p=False, help="hook: receiver endpoints 'host:port[,host:port...]' (engines run serve)")
    flag(
        "store",
        hook=False,
        help="p2p: 'host:port' of the refit group's store when the engine is a separate job (refit rank 0 hosts it; "
        "off loopback set MEGATRON_EXT_EXPORT_AUTHKEY to the same secret in both jobs)",
    )
    flag("engine-tp", hook=False, type=int, help="p2p: engine tensor parallel size")
    flag("engine-dp", hook=False, type=int, help="p2p: engine replicas")
    flag("engine-ep", hook=False, type=int, help="p2p: engine expert parallel size (1: experts TP-sharded)")
    flag("vocab-padding", hook=False, type=int, help="p2p: the engine pads its vocabulary to this multiple (vLLM: 64)")
    flag("vocab-size", p2p=False, type=int, help="hook: HF vocabulary size (trims Megatron's padded embedding rows)")
    flag(
        "bucket-size-mb",
        type=float,
        help=f"bucket size in MiB, at least {MIN_BUCKET_BYTES / (1 << 20):g} (4 KiB) (default: hook, from free "
        f"memory within {MIN_BUCKET_MB}..{MAX_BUCKET_MB}; p2p, {P2P_BUCKET_MB} per peer)",
    )
    flag(
        "quantize",
        choices=QUANTIZE,
        help="none (the model's dtype, default) or fp8-block (decoder-layer linear weights as FP8 e4m3 with "
        "a float32 weight_scale_inv per 128x128 block, as FP8 checkpoints; about half the bytes; not with "
        "ipc-push / ipc-direct)",
    )
    flag("max-inflight", hook=False, type=int, help="p2p: rounds in flight before the oldest is waited on")
    flag(
        "atomic",
        hook=False,
        boolean=True,
        help="p2p: stage the whole version and apply it when all of it arrived (default), or stream",
    )
    flag(
        "atomic-staging",
        hook=False,
        choices=ATOMIC_STAGING,
        help="p2p, atomic: keep the version until it is applied on the device (default: fastest, a second "
        "copy of the engine's share in GPU memory) or in pinned host memory (within --refit-memory-budget-mb)",
    )
    flag(
        "memory-budget-mb",
        hook=False,
        type=memory_budget,
        help="p2p: the most staging memory (MiB) any rank may hold on its device, whatever its number of peers; "
        f"buckets shrink to fit. auto (default): {AUTO_MEMORY_BUDGET_MB} MiB for the staging of every rank, with an "
        "atomic receiver's version kept on the device on top (stage it on the host, or stream, to bound that "
        "too); none: no bound (every pair's buckets at --refit-bucket-size-mb)",
    )
    flag(
        "zero-copy-mb",
        hook=False,
        type=float,
        help="p2p: contiguous runs of at least this many MiB go from the trainer's tensors into a streaming "
        "engine's without staging (no pack or unpack copy, almost no staging memory; an atomic engine stages "
        "them); both jobs must give the same value. Default: off, every byte staged (right for atomic engines, "
        "which stage these runs too); with --no-refit-atomic, 1 keeps the extra memory near swap_model_weights' "
        "(docs/weight_export_reshard.md#zero-copy-transfers)",
    )
    flag("check-finite", boolean=True, help="refuse to publish a version with NaN/Inf weights (default)")
    flag("every-n-steps", type=int, help="refit after every N optimizer steps (0: only when called)")
    flag("backend", choices=BACKENDS, help="backend of the broadcast group or the refit group (auto: nccl on GPU)")
    flag("timeout-s", type=float, help="fail a refit when a peer does not answer within this many seconds")
    return parser
