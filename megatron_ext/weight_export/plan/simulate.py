"""Predicted refit time of a reshard plan, next to a lower bound.

Link model: every GPU has one NVLink port (to GPUs of its node) and one NIC
(to other nodes), each with a per-direction bandwidth, usable at the same time;
ranks ``k * gpus_per_node ...`` share node ``k``. A transfer within a rank is a
device copy (read + write at HBM bandwidth). The schedule's time is the busiest
port's bytes over its bandwidth, plus one latency per staging bucket on the
busiest rank. The lower bound ignores the plan: each destination must receive
every byte it keeps over its fastest path (nothing if it already holds it, else
NVLink if any GPU of its node holds it, else its NIC).

``python -m megatron_ext.weight_export.simulate`` prints the large
configurations (see :data:`CONFIGS`) next to published figures; with
``--all-layers`` also what the first rank of each side plans and stages under a
memory budget (:func:`rank_staging`: its peers, and its buckets and rounds in one
phase and in the phases the budget's planner picks).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections import defaultdict

from ...sharding import TensorSpec, gpt_specs, megatron_layout
from .budget import PHASES, choose_phases, plan_in_phases, rank_words
from .layout import inference_layout
from .reshard_plan import ReshardPlan, build_reshard_plan, fanout_plans

__all__ = ["CONFIGS", "Links", "Prediction", "predict", "sample_layers", "simulate_config"]


@dataclasses.dataclass(frozen=True)
class Links:
    """Per-GPU, per-direction bandwidths in GB/s (1e9 bytes)."""

    nvlink_gbps: float = 450.0  # H100 NVLink 4: 900 GB/s bidirectional
    nic_gbps: float = 50.0  # 400 Gb/s InfiniBand / RoCE per GPU
    hbm_gbps: float = 1500.0  # device copy (counted once per byte: read + write at ~3 TB/s)
    gpus_per_node: int = 8
    latency_s: float = 30e-6  # per staged bucket
    bucket_bytes: int = 256 << 20

    def __post_init__(self):
        for f in ("nvlink_gbps", "nic_gbps", "hbm_gbps", "latency_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Links.{f} must be > 0, got {getattr(self, f)}")
        if self.gpus_per_node < 1 or self.bucket_bytes < 1:
            raise ValueError("Links.gpus_per_node and Links.bucket_bytes must be >= 1")


@dataclasses.dataclass
class Prediction:
    seconds: float
    lower_bound_s: float
    busiest: str  # which port bounds the schedule, e.g. "rank 3 NIC in"
    total_bytes: int  # bytes every destination keeps, summed
    nic_bytes: int
    nvlink_bytes: int
    local_bytes: int
    max_received_bytes: int
    max_sent_bytes: int

    @property
    def efficiency(self) -> float:
        return self.lower_bound_s / self.seconds if self.seconds else 1.0


def _weight(layer_weight: dict[int, float] | None, layer: int | None) -> float:
    return layer_weight.get(layer, 1.0) if (layer_weight and layer is not None) else 1.0


def predict(plan: ReshardPlan, links: Links = Links(), *, layer_weight: dict[int, float] | None = None) -> Prediction:
    """Predicted seconds of ``plan`` and the lower bound. ``layer_weight`` scales
    the bytes of sampled layers (:func:`sample_layers`)."""
    node = lambda r: r // links.gpus_per_node  # noqa: E731
    ports: dict[tuple[int, str], float] = defaultdict(float)  # (rank, "<link> in|out" or "HBM copy") -> bytes
    moved: dict[str, float] = defaultdict(float)  # bytes per link: HBM, NVLink, NIC
    sent: dict[int, float] = defaultdict(float)
    recv: dict[int, float] = defaultdict(float)
    for t in plan.transfers:
        b = t.nbytes * _weight(layer_weight, plan.dst.specs[t.name].layer)
        if t.src == t.dst:
            ports[(t.dst, "HBM copy")] += b
            moved["HBM"] += b
            continue
        link = "NVLink" if node(t.src) == node(t.dst) else "NIC"
        ports[(t.src, f"{link} out")] += b
        ports[(t.dst, f"{link} in")] += b
        moved[link] += b
        sent[t.src] += b
        recv[t.dst] += b
    bw = {"HBM": links.hbm_gbps, "NVLink": links.nvlink_gbps, "NIC": links.nic_gbps}
    busy, seconds = "nothing to move", 0.0
    for (rank, port), b in ports.items():
        s = b / (bw[port.split()[0]] * 1e9)
        if s > seconds:
            busy, seconds = f"rank {rank} {port}", s
    per_rank: dict[int, float] = defaultdict(float)
    for (rank, _port), b in ports.items():
        per_rank[rank] = max(per_rank[rank], b)
    buckets = max((-(-int(b) // links.bucket_bytes) for b in per_rank.values()), default=0)
    seconds += buckets * links.latency_s
    return Prediction(
        seconds,
        _lower_bound(plan, links, layer_weight),
        busy,
        int(sum(moved.values())),
        int(moved["NIC"]),
        int(moved["NVLink"]),
        int(moved["HBM"]),
        int(max(recv.values(), default=0)),
        int(max(sent.values(), default=0)),
    )


def _lower_bound(plan: ReshardPlan, links: Links, layer_weight) -> float:
    node = lambda r: r // links.gpus_per_node  # noqa: E731
    bound = 0.0
    for d in plan.dst.ranks:
        nic_in = nvl_in = 0.0
        for _lt, seg in plan.dst.segments(d):
            spec = plan.dst.specs[seg.name]
            # bytes of this segment by best path: held here, on this node, or off-node
            here = node_bytes = 0
            for r, _, sseg in plan.src.holdings(seg.name):
                inter = sseg.box.intersect(seg.box)
                if inter is None:
                    continue
                if r == d:
                    here += inter.numel
                elif node(r) == node(d):
                    node_bytes += inter.numel
            need = seg.box.numel - min(here, seg.box.numel)
            on_node = min(need, node_bytes)
            scale = spec.dtype.itemsize * _weight(layer_weight, spec.layer)
            nvl_in += on_node * scale
            nic_in += (need - on_node) * scale
        bound = max(bound, nic_in / (links.nic_gbps * 1e9), nvl_in / (links.nvlink_gbps * 1e9))
    return bound


def sample_layers(specs: list[TensorSpec], pp: int) -> tuple[list[TensorSpec], list[int], dict[int, float]]:
    """Keep the first layer of each of ``pp`` stages (for models whose layers
    share one shape). Returns the kept specs, the full model's layer -> stage
    list for :func:`megatron_layout` and each kept layer's weight (layers in its stage)."""
    n = 1 + max(s.layer for s in specs if s.layer is not None)
    stage = [layer * pp // n for layer in range(n)]
    first = {}
    for layer, st in enumerate(stage):
        first.setdefault(st, layer)
    weight = {layer: float(stage.count(st)) for st, layer in first.items()}
    kept = [s for s in specs if s.layer is None or s.layer in weight]
    return kept, stage, weight


QWEN3_4B = dict(
    num_layers=36,
    hidden_size=2560,
    num_heads=32,
    num_groups=8,
    head_dim=128,
    ffn_hidden_size=9728,
    vocab_size=151936,
    tie_embeddings=True,
    qk_norm=True,
)
QWEN3_235B = dict(
    num_layers=94,
    hidden_size=4096,
    num_heads=64,
    num_groups=4,
    head_dim=128,
    ffn_hidden_size=12288,
    vocab_size=151936,
    qk_norm=True,
    num_experts=128,
    moe_ffn_hidden_size=1536,
)
_NEMO_RL = "NeMo-RL NCCL reshard refit, H100"
_235B_TRAINER, _235B_ENGINE = dict(tp=4, pp=8, dp=4, ep=16, etp=1), dict(tp=8, dp=16)

# name: (model kwargs for gpt_specs, trainer layout, engine layout, colocated, published seconds, source)
CONFIGS = {
    "qwen3-4b dp8->tp8": (QWEN3_4B, dict(tp=1, dp=8), dict(tp=8), True, "0.07-0.08", _NEMO_RL),
    "qwen3-235b tp4xpp8xep16 -> tp8xdp16": (QWEN3_235B, _235B_TRAINER, _235B_ENGINE, True, "4.6-4.9", _NEMO_RL),
    "qwen3-235b tp4xpp8xep16 -> tp8xdp16, separate GPUs": (
        QWEN3_235B,
        _235B_TRAINER,
        _235B_ENGINE,
        False,
        "-",
        "(engine on its own 128 GPUs)",
    ),
    "qwen3-4b tp1dp8 -> 32 replicas tp2, separate nodes": (
        QWEN3_4B,
        dict(tp=1, dp=8),
        dict(tp=2, dp=32),
        False,
        "-",
        "(one trainer node feeds 8 engine nodes)",
    ),
    "qwen3-4b tp1dp8 -> 32 replicas tp2, separate nodes, fan-out": (
        QWEN3_4B,
        dict(tp=1, dp=8),
        dict(tp=2, dp=32),
        False,
        "-",
        "(updated replicas serve later ones)",
    ),
}


def rank_staging(
    plans: dict[int, ReshardPlan],
    sides: dict[int, list[int]],
    *,
    budget_bytes: int,
    bucket_bytes: int,
    max_inflight: int,
) -> dict[int, dict]:
    """What each rank of ``plans`` (its own plan) stages under ``budget_bytes``, streaming: its peers, and the
    smallest bucket of its pairs and its rounds per refit in one phase and in the phases
    :func:`~.budget.choose_phases` picks. Each rank stands for the ranks of its side (``sides``: rank ->
    the ranks it stands for; a job whose ranks of one side stage alike), so the phases are chosen from these
    ranks' slot sizes and every peer's slot is its side's."""
    size = dict(bucket_bytes=bucket_bytes, max_inflight=max_inflight, budget_bytes=budget_bytes)
    words = {r: rank_words(plan.transfers, [r], **size)[r] for r, plan in plans.items()}
    chosen = choose_phases(words.values())
    out = {}
    for r, plan in plans.items():
        row = dict(peers=len({p for t in plan.transfers if t.src != t.dst for p in (t.src, t.dst)} - {r}))
        for label, i in (("one_phase", 0), ("phases", chosen)):
            stand = {q: words[s] for s, ranks in sides.items() for q in ranks}
            staged = plan_in_phases(plan.transfers, stand, i, **size, atomic=False, strict=False, rank=r)
            mine = [b for (a, d), b in staged.pair_bytes.items() if r in (a, d)]
            rounds = max((len(bs) for (a, d), bs in staged.buckets.items() if r in (a, d)), default=0)
            row[label] = dict(
                phases=PHASES[i],
                bucket_mib=min(mine, default=0) / (1 << 20),
                rounds=rounds,
                staging_mib=staged.device_bytes.get(r, 0) / (1 << 20),
            )
        out[r] = row
    return out


def simulate_config(
    name: str, links: Links = Links(), *, all_layers: bool = False, staging: dict | None = None
) -> dict:
    """Plan and predict one of :data:`CONFIGS` (sampled layers, or ``all_layers``: the whole model, as a
    rank of that job plans it); returns a JSON-able row."""
    model, mk, ek, colocated, published, source = CONFIGS[name]
    specs = gpt_specs(**model)
    pp = mk.get("pp", 1)
    kept, stage, weight = (specs, None, None) if all_layers else sample_layers(specs, pp)
    t0 = time.perf_counter()
    src = megatron_layout(kept, **mk) if all_layers else megatron_layout(kept, layer_stage=stage, **mk)
    world = len(src.ranks)
    n_dst = ek["tp"] * ek.get("dp", 1)
    dst = inference_layout(kept, **ek, ranks=range(n_dst) if colocated else range(world, world + n_dst))
    if name.endswith("fan-out"):
        tp = ek["tp"]
        replicas = [list(dst.ranks[i : i + tp]) for i in range(0, len(dst.ranks), tp)]
        waves = [predict(p, links, layer_weight=weight) for p in fanout_plans(src, dst, replicas)]
        pred = dataclasses.replace(
            waves[0],
            seconds=sum(w.seconds for w in waves),
            busiest=f"{len(waves)} waves; wave 0: {waves[0].busiest}",
            nic_bytes=sum(w.nic_bytes for w in waves),
            nvlink_bytes=sum(w.nvlink_bytes for w in waves),
            max_sent_bytes=max(w.max_sent_bytes for w in waves),
            max_received_bytes=max(w.max_received_bytes for w in waves),
        )
        pred.lower_bound_s = predict(build_reshard_plan(src, dst), links, layer_weight=weight).lower_bound_s
    else:
        pred = predict(build_reshard_plan(src, dst), links, layer_weight=weight)
    model_bytes = sum(s.nbytes for s in specs)
    plan_s = time.perf_counter() - t0
    rank_plan_s = {}  # what a rank of the job plans: its own transfers (the first rank of each side)
    staged = {}
    if all_layers:
        plans = {}
        for r in sorted({src.ranks[0], dst.ranks[0]}):
            t0 = time.perf_counter()
            plans[r] = build_reshard_plan(src, dst, rank=r)
            rank_plan_s[r] = dict(seconds=time.perf_counter() - t0, transfers=len(plans[r].transfers))
        if staging is not None:
            sides = {src.ranks[0]: list(src.ranks), dst.ranks[0]: [q for q in dst.ranks if q not in src.ranks]}
            staged = rank_staging(plans, sides, **staging)
    return dict(
        config=name,
        trainer=src.description,
        engine=dst.description,
        colocated=colocated,
        model_gb=model_bytes / 1e9,
        predicted_s=pred.seconds,
        lower_bound_s=pred.lower_bound_s,
        busiest=pred.busiest,
        max_recv_gb=pred.max_received_bytes / 1e9,
        max_sent_gb=pred.max_sent_bytes / 1e9,
        nic_gb=pred.nic_bytes / 1e9,
        nvlink_gb=pred.nvlink_bytes / 1e9,
        local_gb=pred.local_bytes / 1e9,
        published_s=published,
        published_by=source,
        plan_s=plan_s,
        rank_plan_s=rank_plan_s,
        rank_staging=staged,
        all_layers=all_layers,
    )


def format_rows(rows: list[dict]) -> str:
    head = (
        f"{'config':<60} {'model GB':>8} {'pred s':>7} {'bound s':>7} {'max recv GB':>11} {'published s':>11}  busiest"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['config']:<60} {r['model_gb']:>8.1f} {r['predicted_s']:>7.3f} {r['lower_bound_s']:>7.3f} "
            f"{r['max_recv_gb']:>11.2f} {r['published_s']:>11}  {r['busiest']}"
        )
    return "\n".join(lines)


def main(argv=None, *, budget_mb: float = 512, bucket_mb: float = 64, max_inflight: int = 2) -> list[dict]:
    """The command; the defaults of the staging flags are the refit's (the front door passes them)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", choices=sorted(CONFIGS), help="default: all")
    p.add_argument("--nvlink-gbps", type=float, default=Links.nvlink_gbps)
    p.add_argument("--nic-gbps", type=float, default=Links.nic_gbps, help="GB/s per GPU (400 Gb/s = 50)")
    p.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
    p.add_argument(
        "--all-layers",
        action="store_true",
        help="plan every layer (slow for large models: plan_s is the layouts and the whole plan; rank_plan_s what "
        "the first trainer and engine rank each plan, their own transfers, as in a job)",
    )
    p.add_argument("--budget-mb", type=float, default=budget_mb, help="--all-layers: the staging budget per rank")
    p.add_argument("--bucket-mb", type=float, default=bucket_mb, help="--all-layers: the bucket per peer")
    p.add_argument("--max-inflight", type=int, default=max_inflight, help="--all-layers: rounds in flight")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    mib = 1 << 20
    staging = dict(
        budget_bytes=int(a.budget_mb * mib), bucket_bytes=int(a.bucket_mb * mib), max_inflight=a.max_inflight
    )
    links = Links(nvlink_gbps=a.nvlink_gbps, nic_gbps=a.nic_gbps, gpus_per_node=a.gpus_per_node)
    rows = []
    for name in a.config or list(CONFIGS):
        print(f"planning {name} ...", flush=True)
        rows.append(simulate_config(name, links, all_layers=a.all_layers, staging=staging))
        print(f"  planned in {rows[-1]['plan_s']:.1f} s (layouts and the whole plan)", flush=True)
        for r, got in rows[-1]["rank_plan_s"].items():
            print(f"  rank {r}'s own plan: {got['transfers']} transfers in {got['seconds']:.2f} s", flush=True)
        for r, got in rows[-1]["rank_staging"].items():
            one, ph = got["one_phase"], got["phases"]
            print(
                f"  rank {r}, {got['peers']} peers, within {a.budget_mb:g} MiB at {a.max_inflight} in flight: "
                f"buckets of {one['bucket_mib']:.2f} MiB in {one['rounds']} rounds in one phase; "
                f"{ph['bucket_mib']:.2f} MiB in {ph['rounds']} rounds in {ph['phases']} phases "
                f"(staging {one['staging_mib']:.0f} / {ph['staging_mib']:.0f} MiB)",
                flush=True,
            )
    print(format_rows(rows))
    if a.json:
        with open(a.json, "w") as f:
            machine = dict(host=platform.node(), platform=platform.platform(), cpus=os.cpu_count())
            when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            args = sys.argv[1:] if argv is None else argv
            command = "python -m megatron_ext.weight_export.simulate " + shlex.join(args)
            meta = dict(date=when, command=command, machine=machine)
            json.dump(dict(**meta, links=dataclasses.asdict(links), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
