"""Configuration of the weight export hook and of the reshard refit, with their argparse flags."""

from __future__ import annotations

import argparse
import dataclasses
import math

__all__ = [
    "TRANSPORTS",
    "ReshardRefitConfig",
    "WeightExportConfig",
    "add_reshard_refit_args",
    "add_weight_export_args",
    "parse_address",
]

TRANSPORTS = ("inprocess", "broadcast", "ipc", "ipc-push", "ipc-direct")
BACKENDS = ("auto", "gloo", "nccl")
MIN_BUCKET_MB, MAX_BUCKET_MB = 16, 1024
# The smallest bucket_size_mb either config accepts: one 4 KiB page. Below it the
# size means nothing: an export bucket (plan.build_plan) rounds every tensor up to
# wire.ALIGN = 256 bytes, so a smaller bucket holds no tensor and each one gets
# an oversized bucket of its own; a reshard bucket (wire.bucketize) starts with a
# 32-byte header padded to wire.ALIGN and cuts transfers into rows of at most
# bucket_bytes - 256 bytes, so a tiny bucket moves a few bytes per message (and at
# 1e-9 MiB, int(bucket_size_mb * 2**20) is 0). And a bucket under a page saves no
# memory: the ipc transports share their buffers as /dev/shm files mapped in whole
# pages, or as CUDA allocations of whole segments.
MIN_BUCKET_BYTES = 4096
PORTS = (1, 65535)


def _host_port(addr: str) -> tuple[str, int] | None:
    """``"host:port"`` as ``(host, port)``; None if it is not of that form or the port is not in
    ``PORTS`` (1..65535). The one parser of the export target and the refit store."""
    host, _, port = addr.strip().rpartition(":")
    if not (host and port.isascii() and port.isdigit() and PORTS[0] <= int(port) <= PORTS[1]):
        return None
    return host, int(port)


def parse_address(addr: str, what: str = "the address") -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; ValueError naming ``what`` otherwise."""
    parsed = _host_port(addr) if isinstance(addr, str) else None
    if parsed is None:
        raise ValueError(f"{what} must be 'host:port' with a port in {PORTS[0]}..{PORTS[1]}, got {addr!r}")
    return parsed


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bucket_size_error(owner: str, value) -> str | None:
    """Why ``bucket_size_mb`` is refused (see MIN_BUCKET_BYTES), or None."""
    if _finite_number(value) and value * (1 << 20) >= MIN_BUCKET_BYTES:
        return None
    return (
        f"{owner}.bucket_size_mb must be > 0: a finite number of MiB >= {MIN_BUCKET_BYTES / (1 << 20):g} "
        f"({MIN_BUCKET_BYTES // 1024} KiB, one page)"
    )


@dataclasses.dataclass
class WeightExportConfig:
    """How and when the trainer streams its weights to inference engines.

    ``target``: the engines' receiver endpoints, ``"host:port[,host:port...]"``
    (unused by ``transport="inprocess"``). ``bucket_size_mb``: bytes per bucket;
    None sizes it from free device memory (5%, within 16..1024 MiB).
    ``every_n_steps``: export after every N optimizer steps (0: only when
    ``exporter.export()`` is called). ``vocab_size``: the HF vocabulary (Megatron's
    padded rows beyond it are not exported). ``check_finite``: refuse to publish a
    version with a NaN or Inf weight (one fused max-abs reduction per bucket on the
    export rank, read once per export: one more read of the exported bytes).
    """

    target: str | None = None
    transport: str = "inprocess"
    bucket_size_mb: float | None = None
    every_n_steps: int = 0
    backend: str = "auto"
    timeout_s: float = 120.0
    vocab_size: int | None = None
    check_finite: bool = True

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"WeightExportConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"WeightExportConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.transport != "inprocess" and not self.target:
            raise ValueError(
                f"WeightExportConfig.target is required for transport={self.transport!r}: the "
                "engines' receiver endpoints as 'host:port[,host:port...]'"
            )
        if self.target:
            bad = [a for a in self.targets if _host_port(a) is None]
            if bad or not self.targets:
                raise ValueError(
                    f"WeightExportConfig.target must be 'host:port[,host:port...]' with every port in "
                    f"{PORTS[0]}..{PORTS[1]}, got {self.target!r}" + (f" ({bad[0]!r} is not)" if bad else "")
                )
        if self.transport == "ipc-push" and len(self.targets) != 1:
            # The same reason IpcPushSender gives, here before any process group or engine is touched.
            raise ValueError(
                f"WeightExportConfig.transport='ipc-push' writes into one engine's weights; got "
                f"{len(self.targets)} targets in target={self.target!r} (use transport='ipc' or "
                "'broadcast' for several engines)"
            )
        if self.bucket_size_mb is not None and (why := _bucket_size_error("WeightExportConfig", self.bucket_size_mb)):
            raise ValueError(f"{why} or None (automatic), got {self.bucket_size_mb}")
        if self.every_n_steps < 0:
            raise ValueError(
                f"WeightExportConfig.every_n_steps must be >= 0 (0: export only when called), got {self.every_n_steps}"
            )
        if not (_finite_number(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"WeightExportConfig.timeout_s must be > 0 and finite (seconds), got {self.timeout_s}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"WeightExportConfig.vocab_size must be > 0, got {self.vocab_size}")

    @property
    def targets(self) -> list[str]:
        return [a.strip() for a in (self.target or "").split(",") if a.strip()]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "WeightExportConfig":
        return cls(
            target=args.weight_export_target,
            transport=args.weight_export_transport,
            bucket_size_mb=args.weight_export_bucket_size_mb,
            every_n_steps=args.weight_export_every_n_steps,
            backend=args.weight_export_backend,
            timeout_s=args.weight_export_timeout_s,
            vocab_size=args.weight_export_vocab_size,
            check_finite=args.weight_export_check_finite,
        )


def add_weight_export_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--weight-export-*`` flags (a Megatron ``extra_args_provider`` works too)."""
    d = WeightExportConfig
    g = parser.add_argument_group("weight export", "stream weights to inference engines (megatron_ext)")
    g.add_argument(
        "--weight-export-target",
        default=d.target,
        help="receiver endpoints 'host:port[,host:port...]' (engines run weight_export.serve)",
    )
    g.add_argument(
        "--weight-export-transport",
        choices=TRANSPORTS,
        default=d.transport,
        help="inprocess; broadcast (NCCL/gloo to engines on other GPUs); ipc (engine on the same GPU, "
        "two shared buffers); ipc-push (one engine on the same GPU, written in place: one target); "
        "ipc-direct (same GPU, TP=PP=1, engine copies from the weights)",
    )
    g.add_argument(
        "--weight-export-bucket-size-mb",
        type=float,
        default=d.bucket_size_mb,
        help=f"bucket size in MiB, at least {MIN_BUCKET_BYTES / (1 << 20):g} (4 KiB) "
        f"(default: from free memory, {MIN_BUCKET_MB}..{MAX_BUCKET_MB})",
    )
    g.add_argument(
        "--weight-export-every-n-steps",
        type=int,
        default=d.every_n_steps,
        help="export after every N optimizer steps (0: off)",
    )
    g.add_argument(
        "--weight-export-backend",
        choices=BACKENDS,
        default=d.backend,
        help="process-group backend of the broadcast transport (auto: nccl on GPU)",
    )
    g.add_argument(
        "--weight-export-timeout-s",
        type=float,
        default=d.timeout_s,
        help="fail an export when a receiver does not answer within this many seconds",
    )
    g.add_argument(
        "--weight-export-vocab-size",
        type=int,
        default=d.vocab_size,
        help="HF vocabulary size (trims Megatron's padded embedding rows)",
    )
    g.add_argument(
        "--weight-export-check-finite",
        action=argparse.BooleanOptionalAction,
        default=d.check_finite,
        help="refuse to publish a version with NaN/Inf weights (one fused check per bucket)",
    )
    return parser


@dataclasses.dataclass
class ReshardRefitConfig:
    """The reshard refit (docs/weight_export_reshard.md) as a training script sets it.

    The engine's layout: ``engine_tp`` x ``engine_dp`` ranks, experts split over
    ``engine_ep`` of them (1: TP-sharded), vocabulary padded to ``vocab_padding``
    rows. The executor: buckets of ``bucket_size_mb`` per peer, ``max_inflight``
    rounds in flight, ``atomic`` (stage the whole version, apply it at the end)
    or streaming, ``check_finite`` (refuse a version with NaN/Inf on every rank before a
    byte moves). ``store``: ``"host:port"`` of the :class:`~.refit_group.RefitGroup`
    when the engine is a separate job (None: its ranks are in this job).
    ``every_n_steps``: refit after every N optimizer steps (0: only when called).
    """

    engine_tp: int = 1
    engine_dp: int = 1
    engine_ep: int = 1
    vocab_padding: int = 64
    bucket_size_mb: float = 64.0
    max_inflight: int = 2
    atomic: bool = True
    check_finite: bool = True
    every_n_steps: int = 0
    store: str | None = None
    backend: str = "auto"
    timeout_s: float = 120.0

    def __post_init__(self):
        for name in ("engine_tp", "engine_dp", "engine_ep", "vocab_padding", "max_inflight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ReshardRefitConfig.{name} must be an integer >= 1, got {value!r}")
        if (self.engine_tp * self.engine_dp) % self.engine_ep:
            raise ValueError(
                f"ReshardRefitConfig.engine_ep must divide engine_tp * engine_dp = "
                f"{self.engine_tp * self.engine_dp}, got {self.engine_ep}"
            )
        if why := _bucket_size_error("ReshardRefitConfig", self.bucket_size_mb):
            raise ValueError(f"{why}, got {self.bucket_size_mb}")
        if self.every_n_steps < 0:
            raise ValueError(
                f"ReshardRefitConfig.every_n_steps must be >= 0 (0: refit only when called), got {self.every_n_steps}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"ReshardRefitConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not (_finite_number(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"ReshardRefitConfig.timeout_s must be > 0 and finite (seconds), got {self.timeout_s}")
        if self.store is not None and _host_port(self.store) is None:
            raise ValueError(
                f"ReshardRefitConfig.store must be 'host:port' with a port in {PORTS[0]}..{PORTS[1]} "
                f"(the refit group's TCP store), got {self.store!r}"
            )

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))

    @property
    def executor_kwargs(self) -> dict:
        """Keyword arguments of ``ReshardExecutor`` / ``FanoutRefit`` / ``TrainerRefit`` / ``EngineRefit``."""
        return dict(
            bucket_bytes=self.bucket_bytes,
            max_inflight=self.max_inflight,
            atomic=self.atomic,
            check_finite=self.check_finite,
        )

    @property
    def store_address(self) -> tuple[str, int] | None:
        return None if self.store is None else _host_port(self.store)

    def engine_layout(self, specs, ranks=None):
        """The engine's :func:`~.layout.inference_layout` on ``ranks`` (default ``0..tp*dp-1``)."""
        from .layout import inference_layout

        return inference_layout(
            specs,
            tp=self.engine_tp,
            dp=self.engine_dp,
            ep=self.engine_ep,
            ranks=ranks,
            vocab_padding=self.vocab_padding,
        )

    def join(self, rank: int, world_size: int, *, device=None):
        """Join the :class:`~.refit_group.RefitGroup` at ``store`` as refit rank ``rank`` of
        ``world_size`` (trainer ranks first, then the engine's), with this config's backend and timeout."""
        import torch

        from .refit_group import RefitGroup

        if self.store_address is None:
            raise ValueError(
                "store is not set: pass --reshard-refit-store host:port (refit rank 0's address) "
                "when the engine runs as a separate job"
            )
        backend = self.backend if self.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        host, port = self.store_address
        return RefitGroup.join(host, port, rank, world_size, backend=backend, device=device, timeout_s=self.timeout_s)

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) ends with a refit."""
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ReshardRefitConfig":
        return cls(**{f.name: getattr(args, "reshard_refit_" + f.name) for f in dataclasses.fields(cls)})


def add_reshard_refit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--reshard-refit-*`` flags (a Megatron ``extra_args_provider`` works too)."""
    d = ReshardRefitConfig
    g = parser.add_argument_group(
        "reshard refit", "move weights from the trainer's layout straight to the engine's (megatron_ext)"
    )
    g.add_argument("--reshard-refit-engine-tp", type=int, default=d.engine_tp, help="engine tensor parallel size")
    g.add_argument("--reshard-refit-engine-dp", type=int, default=d.engine_dp, help="engine replicas")
    g.add_argument(
        "--reshard-refit-engine-ep",
        type=int,
        default=d.engine_ep,
        help="engine expert parallel size (whole experts per rank; 1: experts TP-sharded)",
    )
    g.add_argument(
        "--reshard-refit-vocab-padding",
        type=int,
        default=d.vocab_padding,
        help="the engine pads its vocabulary to a multiple of this many rows (vLLM: 64)",
    )
    g.add_argument(
        "--reshard-refit-bucket-size-mb",
        type=float,
        default=d.bucket_size_mb,
        help=f"staging bucket per peer, MiB, at least {MIN_BUCKET_BYTES / (1 << 20):g} (4 KiB) "
        "(larger: fewer rounds, more staging memory)",
    )
    g.add_argument(
        "--reshard-refit-max-inflight",
        type=int,
        default=d.max_inflight,
        help="rounds in flight before the oldest is waited on",
    )
    g.add_argument(
        "--reshard-refit-atomic",
        action=argparse.BooleanOptionalAction,
        default=d.atomic,
        help="stage the whole version and apply it only when all of it arrived (default); "
        "--no-reshard-refit-atomic streams (max_inflight buckets per peer of staging)",
    )
    g.add_argument(
        "--reshard-refit-check-finite",
        action=argparse.BooleanOptionalAction,
        default=d.check_finite,
        help="refuse a version with NaN/Inf weights on every rank before a byte moves (default)",
    )
    g.add_argument(
        "--reshard-refit-every-n-steps",
        type=int,
        default=d.every_n_steps,
        help="refit after every N optimizer steps (0: off)",
    )
    g.add_argument(
        "--reshard-refit-store",
        default=d.store,
        help="'host:port' of the refit group's TCP store when the engine runs as a separate job",
    )
    g.add_argument(
        "--reshard-refit-backend", choices=BACKENDS, default=d.backend, help="refit group backend (auto: nccl on GPU)"
    )
    g.add_argument(
        "--reshard-refit-timeout-s",
        type=float,
        default=d.timeout_s,
        help="fail a refit group wait (join, plan check, announcement) after this many seconds",
    )
    return parser
