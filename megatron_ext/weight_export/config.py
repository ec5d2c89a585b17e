"""Configuration of the weight export hook, with its argparse flags."""

from __future__ import annotations

import argparse
import dataclasses

__all__ = ["TRANSPORTS", "WeightExportConfig", "add_weight_export_args"]

TRANSPORTS = ("inprocess", "broadcast", "ipc", "ipc-push", "ipc-direct")
BACKENDS = ("auto", "gloo", "nccl")
MIN_BUCKET_MB, MAX_BUCKET_MB = 16, 1024


@dataclasses.dataclass
class WeightExportConfig:
    """How and when the trainer streams its weights to inference engines.

    ``target``: the engines' receiver endpoints, ``"host:port[,host:port...]"``
    (unused by ``transport="inprocess"``). ``bucket_size_mb``: bytes per bucket;
    None sizes it from free device memory (5%, within 16..1024 MiB).
    ``every_n_steps``: export after every N optimizer steps (0: only when
    ``exporter.export()`` is called). ``vocab_size``: the HF vocabulary (Megatron's
    padded rows beyond it are not exported).
    """

    target: str | None = None
    transport: str = "inprocess"
    bucket_size_mb: float | None = None
    every_n_steps: int = 0
    backend: str = "auto"
    timeout_s: float = 120.0
    vocab_size: int | None = None

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.transport != "inprocess" and not self.target:
            raise ValueError(f"target is required for transport={self.transport!r}: the engines' receiver "
                             "endpoints as 'host:port[,host:port...]'")
        if self.target:
            for addr in self.targets:
                host, _, port = addr.rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"target must be 'host:port[,host:port...]', got {self.target!r}")
        if self.bucket_size_mb is not None and not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0 (or None for automatic), got {self.bucket_size_mb}")
        if self.every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0: export only when called), got {self.every_n_steps}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {self.vocab_size}")

    @property
    def targets(self) -> list[str]:
        return [a.strip() for a in (self.target or "").split(",") if a.strip()]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "WeightExportConfig":
        return cls(
            target=args.weight_export_target, transport=args.weight_export_transport,
            bucket_size_mb=args.weight_export_bucket_size_mb, every_n_steps=args.weight_export_every_n_steps,
            backend=args.weight_export_backend, timeout_s=args.weight_export_timeout_s,
            vocab_size=args.weight_export_vocab_size,
        )

    @property
    def enabled_in_training(self) -> bool:
        return self.every_n_steps > 0


def add_weight_export_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--weight-export-*`` flags (a Megatron ``extra_args_provider`` works too)."""
    d = WeightExportConfig
    g = parser.add_argument_group("weight export", "stream weights to inference engines (megatron_ext)")
    g.add_argument("--weight-export-target", default=d.target,
                   help="receiver endpoints 'host:port[,host:port...]' (engines run weight_export.serve)")
    g.add_argument("--weight-export-transport", choices=TRANSPORTS, default=d.transport,
                   help="inprocess; broadcast (NCCL/gloo to engines on other GPUs); ipc (engine on the same GPU, "
                        "two shared buffers); ipc-direct (same GPU, TP=PP=1, engine copies from the weights)")
    g.add_argument("--weight-export-bucket-size-mb", type=float, default=d.bucket_size_mb,
                   help=f"bucket size in MiB (default: from free memory, {MIN_BUCKET_MB}..{MAX_BUCKET_MB})")
    g.add_argument("--weight-export-every-n-steps", type=int, default=d.every_n_steps,
                   help="export after every N optimizer steps (0: off)")
    g.add_argument("--weight-export-backend", choices=BACKENDS, default=d.backend,
                   help="process-group backend of the broadcast transport (auto: nccl on GPU)")
    g.add_argument("--weight-export-timeout-s", type=float, default=d.timeout_s,
                   help="fail an export when a receiver does not answer within this many seconds")
    g.add_argument("--weight-export-vocab-size", type=int, default=d.vocab_size,
                   help="HF vocabulary size (trims Megatron's padded embedding rows)")
    return parser
