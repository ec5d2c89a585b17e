"""Our reshard refit against megatron-core's ``swap_model_weights``: same model, ranks and layouts, one job.

    # 4 GPUs: the default layouts for 4 ranks (colocated TP4 -> TP1xDP4, TP4 -> TP2xDP2,
    # TP2xPP2 -> TP1xDP4; non-colocated TP2 -> TP2, TP2 -> TP1xDP2)
    python benchmarks/refit_vs_swap.py --preset 3b --out refit_vs_swap_3b_4gpu.json
    # 2 GPUs
    python benchmarks/refit_vs_swap.py --preset 3b --world 2 --out refit_vs_swap_3b_2gpu.json
    # MoE, 4 GPUs: the default MoE layouts for 4 ranks (colocated EP4 -> EP2 x expert-DP2, TP2xDP2 EP2
    # -> EP4, PP2xDP2 EP2 -> EP4; non-colocated EP2 -> EP2, TP2 EP2 -> TP1xDP2 EP2)
    python benchmarks/refit_vs_swap.py --preset moe-3b --out refit_vs_swap_moe3b_4gpu.json
    # MoE, 2 GPUs (colocated EP2 -> EP1, TP2 EP2 -> TP1xDP2 EP2; non-colocated TP1 -> TP1)
    python benchmarks/refit_vs_swap.py --preset moe-3b --world 2 --out refit_vs_swap_moe3b_2gpu.json
    # CPU smoke run (gloo): our rows only on a machine without the CUDA driver, where megatron-core's
    # gloo copy service cannot pin its staging buffers (the CPU test runs swap:gloo with a test-only shim)
    python benchmarks/refit_vs_swap.py --preset tiny --device cpu --world 4 --layouts co:tp2dp2:tp1dp4,nc:tp2:tp1dp2

The trainer is a Llama-shaped Megatron ``GPTModel`` (``benchmarks.common`` ``PRESETS``, local layer
spec; ``MOE_PRESETS``: Qwen3-MoE-shaped, 8 SequentialMLP experts per layer, top-2) at layout A, the
engine a second ``GPTModel`` at layout B, both in one ``torch.distributed`` job
(:func:`~megatron_ext.testing.multirank.run_on_ranks`). A layout is ``co:A:B`` (colocated: both
models on ranks ``0..|A|-1``) or ``nc:A:B`` (trainer on ranks ``0..|A|-1``, engine on the next
``|B|``); a side is ``tp<N>[pp<N>][ep<N>][dp<N>]``, ``tp * pp * dp`` ranks (the engine has PP 1, as
megatron-core's inference engine does in ``megatron_ext.weight_export.engines.megatron``). Ranks
outside a layout idle (they still take part in every collective, as both methods require).

Experts (MoE presets only; ``ep`` > 1 with a dense ``--preset`` is refused): each expert is whole on
its EP rank, expert TP 1 on both sides (megatron-core's inference-optimized MoE refuses expert TP,
``transformer/transformer_config.py:1471``; Megatron's MoE recipes train at expert TP 1). So EP
spans the TP x DP ranks of a pipeline stage (Megatron's expert grid: ``etp * ep * edp = tp * dp``):
``ep`` must divide ``tp * dp`` and the preset's experts, and ``dp`` defaults to the fewest replicas
that hold ``ep`` (``tp1ep4`` is TP1 x DP4 with EP4, ``tp2ep2`` TP2 with EP2 on 2 ranks,
``tp1ep2dp4`` EP2 x expert-DP2 on 4 ranks). ``--experts`` picks the expert parameters' names:
``grouped`` (default) renames the local spec's SequentialMLP weights, in place, to Transformer
Engine's TEGroupedMLP names (``mlp.experts.linear_fc1.weight<K>``, ``tiny_llama.as_te_grouped_moe``:
the same tensors, as a TE model with ``moe_grouped_gemm=True`` names them; TE does not run on CPU
nor on the device machines); ``sequential`` keeps SequentialMLP's ``local_experts.<K>.linear_fc1.weight``.
``swap_model_weights`` matches parameters by name and turns an expert's index within its EP rank
into its global index only for names ending in ``weight<K>`` (``megatron/core/resharding/utils.py:131``
``_EXPERT_PARAM_RE`` and ``:143`` ``assign_ep_resolved_name_inplace``, which leaves any other name
as it is, ``:166``): with ``sequential`` names and a different EP size on the two sides its plan
raises where an engine rank holds more experts than a trainer rank (``RuntimeError: Destination
parameter 'decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight' on rank 0 not found in
source model.``, ``resharding/planner.py:344``) and copies the wrong experts where it holds fewer.
Those ``swap`` rows still run and are reported (``correct: false`` with the error or the wrong
parameters, ``unsupported``: why), but do not make the script exit 1. Our layouts keep Megatron's
local expert names and place each expert by its global index (``megatron_layout(ep=, etp=1)`` /
``megatron_engine_layout(ep=, etp=1)``), under either naming.

Process groups: every model gets its own ``ProcessGroupCollection`` from megatron-core's
``megatron.core.inference.shards.build_inference_pg_collection(world_size, tp_size=, pp_size=,
ep_size=, expt_tp_size=1, rank_offset=)`` (two ``HyperCommGrid`` s: ``tp-cp-dp-pp`` and, for
experts, ``etp-ep-edp-pp``, Megatron's rank orders; the builder ``megatron.training`` uses for the
RL inference model), passed as ``GPTModel(pg_collection=)``.
``swap_model_weights`` reads the groups from ``model.pg_collection`` (its planner all-gathers each
parameter's TP/DP/PP group ranks). Non-colocated, the trainer's window starts at rank 0 and the
engine's at ``|A|``; the trainer ranks call ``swap_model_weights(trainer, None, ...)``, the engine
ranks ``swap_model_weights(None, engine, ...)``, the rest ``(None, None)``. One world holds both, so
the group ranks are already global: ``src_rank_offset = dst_rank_offset = 0`` (the offsets shift
group ranks of *independent* worlds into one refit group).

Rows per layout (``--methods``):

- ``swap:<service>``: ``megatron.core.resharding.swap_model_weights(trainer, engine, refit_method=
  service)`` for each copy service that works here (``nccl`` on GPU, plus ``nvshmem`` / ``nixl``
  when their packages import, ``gloo`` only when named; ``gloo`` with ``--device cpu`` where the CUDA
  driver is installed: its staging buffers are pinned host memory). Its plan cache is cleared
  before the first refit.
- ``ours:stream`` / ``ours:stream-zero-copy`` / ``ours:atomic`` / ``ours:atomic-zero-copy`` / ``ours:atomic-host``:
  :class:`~megatron_ext.weight_export.exec.reshard.ReshardExecutor` over
  :class:`~megatron_ext.weight_export.control.peers.DistPeers` (the job's world), from
  ``megatron_layout`` of the trainer to ``megatron_engine_layout`` of the engine (the Megatron ->
  Megatron layouts of ``megatron_engine.py``: padded vocabulary rows copied too), streaming
  ``--stream-bucket-mb`` / atomic ``--atomic-bucket-mb`` buckets, ``--max-inflight`` rounds;
  ``stream-zero-copy`` and ``atomic-zero-copy`` (only when named) send contiguous runs of at least
  ``ZERO_COPY_MIN_BYTES`` zero-copy (``zero_copy_bytes``: from the trainer's tensor, into the engine's when
  streaming, into the atomic receiver's staging otherwise; ``stream`` and ``atomic`` stage every byte);
  ``atomic-host`` keeps the version in pinned host memory until it is applied
  (``atomic_staging="host"``); ``--memory-budget-mb`` bounds every rank's device staging as
  ``--refit-memory-budget-mb`` does: ``auto`` (default, what a refit gets) cuts every row's buckets to
  512 MiB of staging per rank, an atomic receiver's version on the device on top; a number of MiB is strict
  (the ``stream`` and ``atomic-host`` rows within it; ``atomic``, which stages the whole version on the
  device, goes without it); ``none``: no bound. The engine's local tensor
  names get an ``engine/`` prefix in its layout: colocated, both models' Megatron names would
  otherwise collide in the executor's one ``tensors`` dict.

Columns: seconds per refit (median of ``--iters`` after ``--warmup``, the timed refits of a layout's
methods interleaved: each round times one refit of every method, after one untimed round, so that a
drift of the machine moves every row alike; each refit timed on the slowest rank, device
synchronised), GB/s per GPU (bytes the busiest engine rank must receive from other ranks: what it
keeps less what its own trainer shard already holds, the same count for every row / seconds), the
fraction of the measured link limit (GPU: NCCL ``batch_isend_irecv`` over the layout's ranks, every
rank sending to the next and receiving from the previous at once when colocated, trainer rank ``i``
-> engine rank ``|A|+i`` otherwise; CPU: none), peak extra memory on trainer and engine ranks
(``torch.cuda.max_memory_allocated`` over the method's refits minus what was allocated before them;
colocated ranks hold both models, so both columns are the same ranks), the first refit (plans,
services / executors, staging and the first transfer; the median of ``--first-repeats`` cold ones, each
after the last one's buffers were freed and given back to the device, ``first_refit_each_s`` in the JSON:
swap's caches cleared, ours a new executor; interleaved across the layout's methods as the timed refits are,
after each method's first one, which pays what a process does once for a new pattern and is kept apart as
``first_refit_process_s``. Our
NaN/Inf check's kernel is compiled once per
process before the first layout, as a job's refit built at set-up has it before its first refit, and
its compile is reported on its own as ``kernel_compile_s``), the plan alone (``swap``:
``prepare_swap_model_weights``, timed on its own before its cache is cleared again; ours:
``build_reshard_plan(rank=)``, each rank its own part, and the executor, slowest rank) and the
speed-up of our rows over the best ``swap`` row of the layout.

Correctness: every trainer parameter is filled with values drawn from its global name (layer index
with the pipeline offset; an expert's index ``ep_rank * local experts + j``: the same global tensor
at every layout, sharded the way Megatron shards it: ``partition_dim``, ``partition_stride`` over
the TP group, or the expert-TP group for an expert), every engine parameter is set to NaN before
each method, and after the method's last refit every engine rank compares each parameter, exactly,
with its shard of those global tensors (and the trainer its own; ``wrong`` lists global names). A
method that leaves one element wrong, or raises (megatron-core's planner raises on every rank
alike), gets no time in the table (``correct: false``, seconds None) and, unless its row is a known
``unsupported`` one, the script exits 1.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import MOE_PRESETS, PRESETS, provenance, slowest, sync  # noqa: E402

from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402
from megatron_ext.weight_export.config import AUTO_MEMORY_BUDGET_MB, memory_budget  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SWAP_SERVICES = ("nccl", "gloo", "nvshmem", "nixl")
OURS = ("stream", "stream-zero-copy", "atomic", "atomic-zero-copy", "atomic-host")
DEFAULT_OURS = ("stream", "atomic", "atomic-host")  # the zero-copy rows run when named
ENGINE_PREFIX = "engine/"  # the engine's local tensor names in our layout (colocated: distinct from the trainer's)
SEED = 1234


# --------------------------------------------------------------------------- layouts
@dataclasses.dataclass(frozen=True)
class Side:
    """One model's layout: TP x PP x DP ranks; MoE experts over ``ep`` of each stage's TP x DP
    ranks, whole (expert TP 1), replicated over the other ``tp * dp / ep`` (expert DP)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return (
            f"TP{self.tp}"
            + (f"xPP{self.pp}" if self.pp > 1 else "")
            + (f"xDP{self.dp}" if self.dp > 1 else "")
            + (f" EP{self.ep}" if self.ep > 1 else "")
        )


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout pair: the trainer at ``trainer``, the engine at ``engine``, colocated or not."""

    name: str
    colocated: bool
    trainer: Side
    engine: Side

    @property
    def trainer_ranks(self) -> range:
        return range(self.trainer.size)

    @property
    def engine_ranks(self) -> range:
        first = 0 if self.colocated else self.trainer.size
        return range(first, first + self.engine.size)

    @property
    def world(self) -> int:
        return max(self.trainer_ranks.stop, self.engine_ranks.stop)

    def describe(self) -> str:
        if self.colocated:
            return f"colocated {self.trainer} -> {self.engine} ({_ranks(self.trainer_ranks)})"
        return f"{self.trainer} on {_ranks(self.trainer_ranks)} -> {self.engine} on {_ranks(self.engine_ranks)}"


def _ranks(r: range) -> str:
    return f"rank {r.start}" if len(r) == 1 else f"ranks {r.start}-{r.stop - 1}"


_SIDE = re.compile(r"tp(\d+)(?:pp(\d+))?(?:ep(\d+))?(?:dp(\d+))?")


def _side(text: str, what: str) -> Side:
    m = _SIDE.fullmatch(text)
    if m is None:
        raise ValueError(f"{what} {text!r} is not tp<N>[pp<N>][ep<N>][dp<N>]")
    tp, pp, ep, dp = (int(g) if g is not None else None for g in m.groups())
    pp, ep = 1 if pp is None else pp, 1 if ep is None else ep
    if min(tp, pp, ep, 1 if dp is None else dp) < 1:
        raise ValueError(f"{what} {text!r}: sizes must be >= 1")
    if dp is None:  # the fewest DP replicas that EP spans
        dp = ep // math.gcd(ep, tp)
    if (tp * dp) % ep:
        raise ValueError(
            f"{what} {text!r}: ep={ep} must divide tp*dp={tp * dp}. Experts are whole on each EP rank (expert "
            "TP 1), so EP spans the TP x DP ranks of a pipeline stage (Megatron's expert grid: etp*ep*edp = "
            f"tp*dp); e.g. tp{tp}" + (f"pp{pp}" if pp > 1 else "") + f"ep{ep}dp{ep // math.gcd(ep, tp)}"
        )
    return Side(tp, pp, dp, ep)


def parse_case(name: str, num_experts: int = 0) -> Case:
    """``co:A:B`` (colocated) or ``nc:A:B`` (engine on the ranks after the trainer's);
    ``num_experts``: the preset's experts per MoE layer (0: dense, no ``ep`` > 1)."""
    parts = name.split(":")
    if len(parts) != 3 or parts[0] not in ("co", "nc"):
        raise ValueError(f"layout {name!r} is not co:A:B or nc:A:B (e.g. co:tp4:tp1dp4, nc:tp2:tp2)")
    trainer, engine = _side(parts[1], "trainer side"), _side(parts[2], "engine side")
    if engine.pp != 1:
        raise ValueError(f"layout {name!r}: the engine runs pipeline size 1 (megatron-core's inference engine)")
    if parts[0] == "co" and trainer.size != engine.size:
        raise ValueError(f"layout {name!r}: colocated sides need the same ranks, {trainer.size} != {engine.size}")
    for side in (trainer, engine):
        if side.ep > 1 and not num_experts:
            raise ValueError(
                f"layout {name!r}: ep{side.ep} needs a model with experts; the --preset is dense: pick a MoE "
                f"--preset ({', '.join(sorted(MOE_PRESETS))}) or drop ep from --layouts"
            )
        if num_experts and num_experts % side.ep:
            raise ValueError(f"layout {name!r}: ep{side.ep} must divide the preset's {num_experts} experts")
    return Case(name, parts[0] == "co", trainer, engine)


def default_layouts(world: int, moe: bool = False) -> list[str]:
    """The issue's layouts scaled to ``world`` ranks. Dense: TP change, TP -> TP x DP, PP -> DP,
    non-colocated. MoE: EP changes (colocated: EP shrink, TP x EP -> EP, PP x EP -> EP), EP kept
    across ranks with and without a TP change."""
    half = world // 2
    if moe and world == 2:
        return ["co:tp1ep2:tp1dp2", "co:tp2ep2:tp1ep2", "nc:tp1:tp1"]
    if moe:
        return [
            f"co:tp1ep{world}:tp1ep{half}dp{world}",
            f"co:tp2ep{half}dp{half}:tp1ep{world}",
            f"co:tp1pp2ep{half}:tp1ep{world}",
            f"nc:tp1ep{half}:tp1ep{half}",
            f"nc:tp2ep{half}:tp1ep{half}",
        ]
    if world == 2:
        return ["co:tp2:tp1dp2", "co:tp1pp2:tp1dp2", "nc:tp1:tp1"]
    return [
        f"co:tp{world}:tp1dp{world}",
        f"co:tp{world}:tp2dp{half}",
        f"co:tp{half}pp2:tp1dp{world}",
        f"nc:tp{half}:tp{half}",
        f"nc:tp{half}:tp1dp{half}",
    ]


SEQUENTIAL_EP_CHANGE = (
    "megatron-core's swap_model_weights matches experts by name and turns an expert's index within its EP rank "
    "into the global one only for TEGroupedMLP's numbered weights (linear_fc1.weight<K>: "
    "megatron/core/resharding/utils.py, _detect_expert_index_from_param_name and assign_ep_resolved_name_inplace), "
    "so SequentialMLP's local_experts.<K> cannot move between EP sizes: the plan raises where the destination "
    "holds more experts per rank ('... not found in source model', resharding/planner.py) and copies another "
    "expert where it holds fewer; run --experts grouped"
)


def swap_problem(case: Case, experts: str | None) -> str | None:
    """Why ``swap_model_weights`` cannot give the engine the trainer's weights in ``case``
    (None: it can); ``experts``: ``"sequential"`` / ``"grouped"`` parameter names, None if dense."""
    if experts == "sequential" and case.trainer.ep != case.engine.ep:
        return SEQUENTIAL_EP_CHANGE
    return None


NO_DRIVER_GLOO = (
    "swap:gloo cannot run on a machine without the CUDA driver: megatron-core's GlooCopyService stages "
    "every transfer in pinned host memory (torch.empty(..., pin_memory=True) in submit_recv and run), "
    "which raises 'Found no NVIDIA driver'"
)


def available_methods(gpu: bool, driver: bool | None = None) -> list[str]:
    """The rows that run by default: the copy services that work on this machine, then ours.
    ``driver``: whether the CUDA driver is there (default: ask torch); without it megatron-core's
    gloo service cannot pin its staging buffers, so a CPU-only machine runs our rows only."""
    driver = torch.cuda.is_available() if driver is None else driver
    services = ["nccl"] if gpu else ["gloo"] if driver else []
    if gpu:  # the modules megatron-core's NVSHMEM / NIXL copy services import
        services += [s for s, pkg in (("nvshmem", "nvshmem.core"), ("nixl", "nixl._api")) if _importable(pkg)]
    return [f"swap:{s}" for s in services] + [f"ours:{m}" for m in DEFAULT_OURS]


def _importable(pkg: str) -> bool:
    try:
        return importlib.util.find_spec(pkg) is not None
    except (ImportError, ValueError):
        return False


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    known = [f"swap:{s}" for s in SWAP_SERVICES] + [f"ours:{m}" for m in OURS]
    bad = [m for m in methods if m not in known]
    if bad or not methods:
        raise ValueError(f"--methods: unknown {bad}; choose from {known}")
    return methods


# --------------------------------------------------------------------------- models and weights
_PGCS: dict[tuple[int, int, int, int, int], object] = {}


def _pg_collection(size: int, side: Side, offset: int):
    """megatron-core's groups for a model on ranks ``offset..offset+size-1`` (every rank calls it:
    ``new_group`` is collective), experts at expert TP 1 over ``side.ep`` ranks. Memoised: layouts
    that share a side share its groups."""
    from megatron.core.inference.shards import build_inference_pg_collection

    key = (size, side.tp, side.pp, side.ep, offset)
    if key not in _PGCS:
        _PGCS[key] = build_inference_pg_collection(
            size, tp_size=side.tp, pp_size=side.pp, cp_size=1, ep_size=side.ep, expt_tp_size=1, rank_offset=offset
        )
    return _PGCS[key]


def _build_gpt(spec, base_config, side: Side, pgc, device, experts: str | None):
    """This rank's ``GPTModel`` at ``side`` with groups ``pgc``: ``tiny_llama.build_model``'s model
    (local spec, RoPE, RMSNorm, SwiGLU, GQA; MoE presets: SequentialMLP experts), with explicit
    process groups (``build_model`` reads ``parallel_state``, which cannot describe two layouts at
    once), in bf16 under ``Float16Module`` (as ``benchmarks/refit_reshard.py`` and the engine command
    wrap it). ``experts="grouped"``: the parameters renamed, in place, to what Transformer Engine's
    layer spec with ``moe_grouped_gemm=True`` calls them (``tiny_llama.as_te_grouped_moe``: the same
    tensors; TEGroupedMLP's ``experts.linear_fc{1,2}.weight<K>``, the fused
    ``linear_qkv.layer_norm_weight``). Weights are not initialised: :func:`_fill_trainer` / NaN set them."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.sharding.names import unwrap
    from megatron_ext.testing.tiny_llama import as_te_grouped_moe

    config = copy.deepcopy(base_config)  # as megatron.training builds its RL inference model's config
    config.tensor_model_parallel_size = side.tp
    config.pipeline_model_parallel_size = side.pp
    config.expert_model_parallel_size = side.ep
    config.expert_tensor_parallel_size = 1
    config.perform_initialization = False
    pp_rank, pp_size = pgc.pp.rank(), pgc.pp.size()
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        ),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        pg_collection=pgc,
    )
    model = Float16Module(config, model.to(device))
    if experts == "grouped":
        as_te_grouped_moe(unwrap(model))
    return model


_EXPERT_INDEX = re.compile(r"(\.local_experts\.)(\d+)(?=\.)|(\.experts\.linear_fc[12]\.weight)(\d+)$")


def _global_params(model):
    """``(global name, parameter)``: layer indices with the pipeline offset applied (the names of
    ``megatron_tensors``, i.e. of our layouts) and, for an expert, its global index (``ep_rank *
    local experts + j``) in place of Megatron's index ``j`` within the EP rank, which our layouts keep
    in their local tensor names: an expert's values come from the same name at every EP size."""
    from megatron_ext.sharding.names import global_layer_names, global_name, unwrap

    gpt = unwrap(model)
    prefixes = global_layer_names(gpt)
    ep, num_experts = gpt.pg_collection.ep, gpt.config.num_moe_experts or 0
    first = ep.rank() * (num_experts // ep.size()) if num_experts else 0

    def expert(m: re.Match) -> str:
        return f"{m.group(1) or m.group(3)}{first + int(m.group(2) or m.group(4))}"

    return [(_EXPERT_INDEX.sub(expert, global_name(n, prefixes)), p) for n, p in gpt.named_parameters()]


def _expected(name: str, p: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's shard of the global tensor ``name`` (values drawn from the name alone), split as
    Megatron splits a TP parameter: ``tp * partition_stride`` chunks on ``partition_dim``, rank ``r``
    keeping chunks ``r, r + tp, ...`` (stride 2: the ``[gate_r; up_r]`` of a GLU ``linear_fc1``).
    ``tp``: the parameter's TP group (the expert-TP group for an expert)."""
    split = bool(getattr(p, "tensor_model_parallel", False))
    dim, stride = int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1))
    shape = list(p.shape)
    if split:
        shape[dim] *= tp
    gen = torch.Generator(device=p.device).manual_seed(zlib.crc32(f"{SEED}:{name}".encode()))
    full = torch.randn(shape, generator=gen, device=p.device, dtype=torch.float32)
    if split:
        full = torch.cat(full.chunk(tp * stride, dim)[tp_rank::tp], dim)
    return full.to(p.dtype)


def _shards(model):
    """``(global name, parameter, TP size, TP rank)`` of every parameter: an expert's (Megatron marks
    its parameters ``allreduce=False``) over the expert-TP group, the others over TP."""
    from megatron_ext.sharding.names import unwrap

    pgc = unwrap(model).pg_collection
    dense, expert = (pgc.tp.size(), pgc.tp.rank()), (pgc.expt_tp.size(), pgc.expt_tp.rank())
    return [(n, p, *(dense if getattr(p, "allreduce", True) else expert)) for n, p in _global_params(model)]


@torch.no_grad()
def _fill_trainer(model) -> None:
    for name, p, tp, r in _shards(model):
        p.copy_(_expected(name, p, tp, r))


@torch.no_grad()
def _wrong(model) -> list[str]:
    """Parameters of ``model`` that are not exactly their shard of the global tensors."""
    return [name for name, p, tp, r in _shards(model) if not torch.equal(p, _expected(name, p, tp, r))]


def _prefixed(layout, prefix: str):
    """``layout`` with every local tensor renamed ``prefix + name`` (the plan names tensors by these)."""
    renamed: dict[int, dict] = {}  # replicas that share one dict of local tensors keep sharing it
    tensors = {}
    for r, locs in layout.tensors.items():
        if id(locs) not in renamed:
            renamed[id(locs)] = {prefix + n: dataclasses.replace(lt, name=prefix + n) for n, lt in locs.items()}
        tensors[r] = renamed[id(locs)]
    return dataclasses.replace(layout, tensors=tensors, recipe=None)


# --------------------------------------------------------------------------- timing


def _together(device) -> float:
    """Every rank here, its device idle: the start of a timed or profiled refit (a wait for a late peer is not
    the refit's). Returns the time."""
    import torch.distributed as dist

    sync(device)
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter()


def _cold(device) -> None:
    """What the last refit, row or layout left, freed and its memory given back to the device: before each cold
    first refit (so it allocates its buffers as a new job's first one does), each row and each layout."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(fn, device) -> float:
    """One call of ``fn`` on every rank, timed on the slowest rank (devices synchronised around it)."""
    start = _together(device)
    fn()
    sync(device)
    return slowest(time.perf_counter() - start, device)


def _profiled(fn, device, path: str) -> float:
    """``fn`` (a refit) under ``torch.profiler`` (host and device): its chrome trace written to ``path``
    (for chrome://tracing or Perfetto) and, beside it (``.txt``), the 40 operators of most host time.
    Returns the seconds it took, profiler included."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = _together(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    took = time.perf_counter() - start
    folder, name = os.path.split(path)
    os.makedirs(folder or ".", exist_ok=True)
    name = name.replace(":", "-")
    prof.export_chrome_trace(os.path.join(folder, name))
    with open(os.path.join(folder, os.path.splitext(name)[0] + ".txt"), "w") as f:
        f.write(f"{took * 1e3:.1f} ms under the profiler\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    return took


def _python_profiled(fn, device, path: str) -> float:
    """``fn`` (a refit) under ``cProfile``: the host's Python functions, 40 by own time and 40 by cumulative
    time, written to ``path`` (text; the whole profile beside it, for ``pstats``, where ``path`` ends in ``.txt``
    without it). Returns the seconds it took, profiler included."""
    import cProfile
    import io
    import pstats

    start = _together(device)
    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync(device)
    prof.disable()
    took = time.perf_counter() - start
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(40)
    with open(path, "w") as f:
        f.write(f"{took * 1e3:.1f} ms under cProfile\n{text.getvalue()}")
    if path.endswith(".txt"):
        prof.dump_stats(path.removesuffix(".txt"))
    return took


def _link_limit(case: Case, rank: int, nbytes: int, device) -> float | None:
    """GB/s per GPU of NCCL point-to-point over the layout's ranks, all pairs at once (None on CPU)."""
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    if case.colocated:  # every rank sends to the next and receives from the previous: both directions busy
        ranks = list(case.trainer_ranks)
        pairs = [(ranks[j], ranks[(j + 1) % len(ranks)]) for j in range(len(ranks))] if len(ranks) > 1 else []
    else:  # trainer rank j -> engine rank j
        n = min(len(case.trainer_ranks), len(case.engine_ranks))
        pairs = [(case.trainer_ranks[j], case.engine_ranks[j]) for j in range(n)]
    sends = [dst for src, dst in pairs if src == rank]
    recvs = [src for src, dst in pairs if dst == rank]
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in sends + recvs]

    def p2p():
        ops = [dist.P2POp(dist.isend, b, peer) for b, peer in zip(bufs, sends)]
        ops += [dist.P2POp(dist.irecv, b, peer) for b, peer in zip(bufs[len(sends) :], recvs)]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    _timed(p2p, device)  # warm-up: the pairs' communicators
    seconds = statistics.median(_timed(p2p, device) for _ in range(3))
    return nbytes / seconds / 1e9 if pairs else None


# --------------------------------------------------------------------------- one rank
def _rank(preset: str, cases: list[Case], methods: list[str], opts: dict, rank_setup=None):
    if rank_setup is not None:  # before anything of megatron-core is bound here
        rank_setup()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.resharding.refit import clear_all_caches
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from benchmarks.common import megatron_config, spec_for
    from megatron_ext import copy_check
    from megatron_ext.sharding import megatron_layout, specs_from_config
    from megatron_ext.weight_export.megatron_refit import megatron_engine_layout, megatron_engine_specs
    from megatron_ext.weight_export.exec.reshard import megatron_tensors
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    rank = dist.get_rank()
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    # parallel_state at TP1: the global state megatron-core's modules expect (RNG tracker); every
    # model below takes its own groups
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(SEED)
    spec = spec_for(preset)
    base_config = megatron_config(spec, gpu)
    experts = opts["experts"]
    grouped = experts == "grouped"
    specs = specs_from_config(
        base_config,
        vocab_size=spec.hf_vocab_size,
        padded_vocab_size=spec.vocab_size,
        tie_embeddings=spec.tie_embeddings,
        dtype=torch.bfloat16,
        te_layernorm=grouped,
        grouped_gemm=grouped,
    )
    versions = iter(range(1, 10**9))
    # the checked copy's kernel, compiled once per process: a job starts it when it builds its refit (at set-up,
    # before training) and it ends long before the first refit; here it ends before the first layout, so a
    # first refit measures the layout's own cost, not a compiler next to it in the process (timed apart)
    compile_s = None
    if gpu and opts["check_finite"] and any(m.startswith("ours") for m in methods) and copy_check.available():
        start = time.perf_counter()
        # the check-only variant too: zero-copy senders' and atomic ranks' local sources' check
        check_only = any(m.endswith("zero-copy") or m.startswith("ours:atomic") for m in methods)
        copy_check.prewarm(device, (torch.bfloat16, torch.float32), wait=True, check_only=check_only)
        compile_s = slowest(time.perf_counter() - start, device)
    out = []
    for case in cases:
        t_pgc = _pg_collection(case.trainer.size, case.trainer, 0)
        e_pgc = _pg_collection(case.engine.size, case.engine, case.engine_ranks.start)
        is_trainer, is_engine = rank in case.trainer_ranks, rank in case.engine_ranks
        trainer = _build_gpt(spec, base_config, case.trainer, t_pgc, device, experts) if is_trainer else None
        engine = _build_gpt(spec, base_config, case.engine, e_pgc, device, experts) if is_engine else None
        if trainer is not None:
            _fill_trainer(trainer)
        t, e = case.trainer, case.engine
        src = megatron_layout(
            megatron_engine_specs(specs), tp=t.tp, pp=t.pp, dp=t.dp, ep=t.ep, etp=1, ranks=case.trainer_ranks
        )
        dst = _prefixed(
            megatron_engine_layout(specs, tp=e.tp, dp=e.dp, ep=e.ep, etp=1, ranks=case.engine_ranks), ENGINE_PREFIX
        )
        tensors = dict(megatron_tensors(trainer)) if trainer is not None else {}
        if engine is not None:
            tensors.update({ENGINE_PREFIX + n: t for n, t in megatron_tensors(engine).items()})
        plan = build_reshard_plan(src, dst)  # for the byte count; every "ours" row builds its own, timed
        link_bytes = sum(t.nbytes for t in plan.transfers if t.dst == rank and t.src != rank)
        del plan
        res = dict(
            case=case.name,
            kernel_compile_s=compile_s,
            trainer=is_trainer,
            engine=is_engine,
            link_bytes=link_bytes,
            limit_gbps=_link_limit(case, rank, opts["limit_bytes"], device),
            methods={},
        )
        live, firsts = {}, {}  # each method's steady-state refit (kept until the timed rounds) and cold first one
        for method in methods:
            res["methods"][method], fn, first = _method(
                method, trainer, engine, src, dst, tensors, rank, versions, dict(opts, case=case.name), device
            )
            if fn is not None:
                live[method] = fn
            if first is not None:
                firsts[method] = first
        _first_refits(res["methods"], firsts, opts["first_repeats"])
        # the timed refits, interleaved (one refit of each method per round, after a round untimed; the order
        # rotates): a drift of the machine (swap_model_weights moved by up to 25% between runs) hits every
        # method alike
        for fn in live.values():
            _timed(fn, device)
        order = list(live)
        for i in range(opts["iters"]):
            for method in order[i % len(order) :] + order[: i % len(order)]:  # each round starts one further
                res["methods"][method]["times"].append(_timed(live[method], device))
        if opts.get("profile_dir"):
            for method, fn in live.items():
                _profiled(fn, device, os.path.join(opts["profile_dir"], f"{case.name}_{method}_rank{rank}.json"))
        live = None
        clear_all_caches()
        out.append(res)
        trainer = engine = tensors = None  # this layout's models go before the next one's are built
        _cold(device)
    clear_all_caches()
    return out


def _method(method, trainer, engine, src, dst, tensors, rank, versions, opts, device):
    """One row on this rank, but its timed refits: the engine set to NaN, the first refit, ``warmup``
    refits (the peak memory), then the exact check of both models. Returns the row (``times`` empty)
    and the steady-state refit for the layout's interleaved timed rounds (None where the first refit
    failed on a rank: every rank then returns None)."""
    from megatron.core.resharding.refit import clear_all_caches, prepare_swap_model_weights, swap_model_weights

    from megatron_ext.weight_export.control.peers import DistPeers
    from megatron_ext.weight_export.exec.reshard import ReshardExecutor
    from megatron_ext.weight_export.plan.direct import ZERO_COPY_MIN_BYTES
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    gpu = device.type == "cuda"
    kind, what = method.split(":")
    if engine is not None:
        with torch.no_grad():
            for p in engine.parameters():
                p.fill_(float("nan"))
    if kind == "swap":  # an earlier swap row's services and plan (kept for the timed rounds) are not this row's
        clear_all_caches()
    _cold(device)
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    state = {}
    first = plan_s = error = setup = first_each = None
    times = []  # filled by the layout's interleaved timed rounds
    cold_first = None  # one cold first refit: (seconds, plan seconds or None, set-up or None), slowest rank
    if kind == "swap":

        def refit():
            swap_model_weights(trainer, engine, refit_method=what, src_rank_offset=0, dst_rank_offset=0)

        def cold_first():
            clear_all_caches()  # (the plan too, within the first refit)
            _cold(device)
            return _timed(refit, device), None, None

        try:
            clear_all_caches()  # the plan alone (collective: an all-gather of every rank's metadata) ...
            plan_s = _timed(lambda: prepare_swap_model_weights(trainer, engine), device)
            first_each = [cold_first()[0]]  # ... then a first refit (the process's first of this pattern)
            first = first_each[0]
        except Exception as exc:  # megatron-core's planner replays the whole plan on every rank: all raise alike
            error = f"{type(exc).__name__}: {exc}"
    else:
        streaming = what.startswith("stream")
        bucket = opts["stream_bucket"] if streaming else opts["atomic_bucket"]
        # a strict budget would refuse the atomic row's version on the device: that row goes without it
        budget = (
            opts.get("memory_budget")
            if what not in ("atomic", "atomic-zero-copy") or not opts["memory_budget_strict"]
            else None
        )

        def first_refit():  # the plan, the executor, its staging and the first-refit agreement
            start = time.perf_counter()
            state["ex"] = ReshardExecutor(
                build_reshard_plan(src, dst, rank=rank),  # this rank's transfers, as TrainerRefit / EngineRefit plan
                rank,
                tensors,
                group=DistPeers(),
                bucket_bytes=bucket,
                max_inflight=opts["max_inflight"],
                atomic=not streaming,
                zero_copy_bytes=ZERO_COPY_MIN_BYTES if what.endswith("zero-copy") else None,
                atomic_staging="host" if what == "atomic-host" else "device",
                memory_budget_bytes=budget,
                memory_budget_strict=opts["memory_budget_strict"],
                check_finite=opts["check_finite"],
            )
            state["plan_s"] = time.perf_counter() - start  # no communication: every rank plans its own part
            state["ex"].refit(next(versions))

        def refit():
            state["ex"].refit(next(versions))

        def timings(took):  # the executor just built: (first refit, plan, set-up), each the slowest rank's
            setup = {k: slowest(v, device) for k, v in sorted(state["ex"].setup_s.items())}
            return took, slowest(state["plan_s"], device), setup

        if opts.get("profile_first"):  # a cold first refit under a profiler (once)
            name = f"{opts['case']}_{method}_first_rank{rank}".replace(":", "-")
            where = os.path.join(opts["profile_dir"], name)
            # one unprofiled first: what a process pays once (the first point-to-point ops of its pattern, e.g.
            # NCCL's connections for small messages) would otherwise fill the profile; the interleaved repeats
            # leave it out too
            _cold(device)
            _timed(first_refit, device)
            state["ex"] = None
            _cold(device)
            if opts["profile_first"] == "python":
                took = _python_profiled(first_refit, device, where + ".pstats.txt")
            else:
                took = _profiled(first_refit, device, where + ".json")
            first, plan_s, setup = timings(slowest(took, device))
        else:

            def cold_first():  # a new executor: plan, staging, agreement, first transfer
                state["ex"] = None  # the previous one's staging freed first
                _cold(device)
                return timings(_timed(first_refit, device))

            first, plan_s, setup = cold_first()  # the process's first of this pattern; the repeats come interleaved
        first_each = [first]
    ran = slowest(float(error is not None), device) == 0  # every rank ran the first refit
    if ran:
        for _ in range(opts["warmup"]):
            _timed(refit, device)
    else:
        first = plan_s = None
    peak = torch.cuda.max_memory_allocated(device) - base if gpu else None
    ex = state.get("ex")
    wrong = (_wrong(engine) if engine is not None else []) + (
        [f"trainer {n}" for n in _wrong(trainer)] if trainer is not None else []
    )
    row = dict(
        first_s=first,  # the median of first_each_s (the interleaved repeats replace both: _first_refits)
        first_each_s=first_each,  # each cold first refit
        plan_s=plan_s,
        first_setup_s=setup,  # ours: the first refit's settle, staging, agreement and start (s, slowest rank)
        times=times,
        error=error,
        peak_extra_bytes=peak,
        wrong=wrong[:5],
        wrong_count=len(wrong),
        checked=(trainer is not None) + (engine is not None),
        rounds=ex.rounds if ex is not None else None,
        phases=ex.phases if ex is not None else None,  # the pairs' phases (plan/budget.py; 1 unless many peers)
        staging_bytes=ex.staging_bytes if ex is not None else None,
        staging_host_bytes=ex.staging_host_bytes if ex is not None else None,
    )
    return row, (refit if ran else None), (cold_first if ran and not opts.get("profile_first") else None)


def _first_refits(rows: dict, firsts: dict, repeats: int) -> None:
    """``repeats`` cold first refits of every method of a layout (``firsts``: each method's, see :func:`_method`),
    interleaved as the timed refits are (a round of one of each, the order rotating), so that a drift of the
    machine moves every method alike (one host's plans took twice as long from one minute to the next): each
    row's first refit becomes their median, its plan and set-up too; the one :func:`_method` ran first (what a
    process pays once for a new pattern, e.g. NCCL's connections) is kept apart, ``first_process_s``."""
    order = list(firsts)
    runs = {m: [] for m in order}
    for i in range(repeats if order else 0):
        for method in order[i % len(order) :] + order[: i % len(order)]:
            runs[method].append(firsts[method]())
    for method, got in runs.items():
        row = rows[method]
        row["first_process_s"] = row["first_each_s"][0]
        row["first_each_s"] = [t for t, _, _ in got]
        row["first_s"] = statistics.median(row["first_each_s"])
        if got[0][1] is not None:  # ours: each repeat's plan and set-up
            row["plan_s"] = statistics.median(p for _, p, _ in got)
            row["first_setup_s"] = {k: statistics.median(s[k] for _, _, s in got) for k in got[0][2]}


# --------------------------------------------------------------------------- the table
def _rows(cases: list[Case], methods: list[str], res: list[list[dict]], experts: str | None = None) -> list[dict]:
    rows = []
    for ci, case in enumerate(cases):
        per_rank = [r[ci] for r in res]
        link = max((r["link_bytes"] for r in per_rank if r["engine"]), default=0)
        limits = [r["limit_gbps"] for r in per_rank if r["limit_gbps"] is not None]
        limit = min(limits) if limits else None
        case_rows = []
        for method in methods:
            ms = [r["methods"][method] for r in per_rank]
            wrong = sum(m["wrong_count"] for m in ms)
            checked = sum(m["checked"] for m in ms)
            error = next((m["error"] for m in ms if m["error"]), None)
            correct = error is None and wrong == 0 and checked >= len(case.trainer_ranks) + len(case.engine_ranks)
            seconds = statistics.median(ms[0]["times"]) if correct else None  # all-reduced: equal on every rank
            gbps = link / seconds / 1e9 if seconds else None

            def peak(side, ms=ms):
                vals = [m["peak_extra_bytes"] for r, m in zip(per_rank, ms) if r[side]]
                return max(vals) if vals and vals[0] is not None else None

            case_rows.append(
                dict(
                    layout=case.name,
                    description=case.describe(),
                    colocated=case.colocated,
                    method=method,
                    seconds=seconds,
                    gbps_per_gpu=gbps,
                    fraction_of_limit=gbps / limit if gbps is not None and limit else None,
                    first_refit_s=ms[0]["first_s"] if correct else None,
                    first_refit_each_s=ms[0]["first_each_s"] if correct else None,
                    first_refit_process_s=ms[0].get("first_process_s") if correct else None,
                    plan_s=ms[0]["plan_s"],
                    first_setup_s=ms[0]["first_setup_s"],
                    peak_extra_trainer_bytes=peak("trainer"),
                    peak_extra_engine_bytes=peak("engine"),
                    correct=correct,
                    error=error,
                    unsupported=swap_problem(case, experts) if method.startswith("swap") else None,
                    checked_ranks=checked,
                    wrong=[w for m in ms for w in m["wrong"]][:5],
                    times_s=ms[0]["times"] if correct else None,
                    rounds=max((m["rounds"] or 0 for m in ms), default=0) if method.startswith("ours") else None,
                    phases=max((m.get("phases") or 0 for m in ms), default=0) if method.startswith("ours") else None,
                    staging_bytes=max((m["staging_bytes"] or 0 for m in ms), default=0)
                    if method.startswith("ours")
                    else None,
                    staging_host_bytes=max((m.get("staging_host_bytes") or 0 for m in ms), default=0)
                    if method.startswith("ours")
                    else None,
                    link_bytes=link,
                    limit_gbps=limit,
                )
            )
        swaps = [r["seconds"] for r in case_rows if r["method"].startswith("swap") and r["seconds"]]
        for r in case_rows:
            r["speedup_vs_best_swap"] = min(swaps) / r["seconds"] if swaps and r["seconds"] else None
        rows += case_rows
    return rows


def _fmt(v, spec: str, scale: float = 1.0, none: str = "-") -> str:
    return none if v is None else format(v * scale, spec)


def _verdict(r: dict) -> str:
    if r["correct"]:
        return "yes"
    why = r["error"][:160] if r["error"] else f"{r['checked_ranks']} ranks checked, wrong {r['wrong']}"
    return "NO" + (" (megatron-core cannot: see below)" if r["unsupported"] else "") + f": {why}"


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'method':13} {'ms/refit':>9} {'GB/s/GPU':>9} {'of limit':>8} {'first ms':>9} {'plan ms':>8} "
        f"{'+MiB train':>10} {'+MiB engine':>11} {'vs swap':>7}  correct"
    )
    layout = None
    for r in rows:
        if r["layout"] != layout:
            layout = r["layout"]
            limit = _fmt(r["limit_gbps"], ".1f", none="none (CPU)")
            print(
                f"\n{layout}: {r['description']}; busiest engine rank receives {r['link_bytes'] / 1e9:.3f} GB "
                f"over links; link limit {limit} GB/s per GPU"
            )
            print(head + "\n" + "-" * len(head))
        print(
            f"{r['method']:13} {_fmt(r['seconds'], '9.2f', 1e3):>9} {_fmt(r['gbps_per_gpu'], '9.1f'):>9} "
            f"{_fmt(r['fraction_of_limit'], '8.0%'):>8} {_fmt(r['first_refit_s'], '9.1f', 1e3):>9} "
            f"{_fmt(r['plan_s'], '8.1f', 1e3):>8} "
            f"{_fmt(r['peak_extra_trainer_bytes'], '10.1f', 1 / MiB):>10} "
            f"{_fmt(r['peak_extra_engine_bytes'], '11.1f', 1 / MiB):>11} "
            f"{_fmt(r['speedup_vs_best_swap'], '.2f') + ('x' if r['speedup_vs_best_swap'] else ''):>7}  " + _verdict(r)
        )
    for reason in dict.fromkeys(r["unsupported"] for r in rows if r["unsupported"]):
        print(f"\nswap rows marked 'megatron-core cannot': {reason}")


def targets(rows: list[dict]) -> list[str]:
    """The refit budget's targets per layout and row of ours, against the best swap row: extra memory at
    most swap's on the trainer ranks and on the engine ranks (each side against the same side: a trainer
    near its memory limit gains nothing from an engine side that holds less), at least 1.5x faster, the
    first refit no slower. Without device memory (CPU) the memory verdict is n/a. A speed target not met says
    what share of the measured link limit 1.5x swap needs (swap's share times 1.5): above 100% no plan of
    this layout's bytes can meet it."""
    lines = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        swaps = [r for r in mine if r["method"].startswith("swap") and r["correct"]]
        if not swaps:
            continue
        best = min(swaps, key=lambda r: r["seconds"])
        for r in (r for r in mine if r["method"].startswith("ours") and r["correct"]):
            key = "peak_extra_{}_bytes".format
            sides = [(side, r[key(side)], best[key(side)]) for side in ("trainer", "engine")]
            sides = [(side, a, b) for side, a, b in sides if a is not None and b is not None]
            if not sides:
                mem = "n/a"
            else:
                mem = "met" if all(a <= b for _, a, b in sides) else "NOT met"
                mem += " (" + ", ".join(f"{side} {a / MiB:.1f} vs {b / MiB:.1f} MiB" for side, a, b in sides) + ")"
            speed = best["seconds"] / r["seconds"]
            need = 1.5 * best["fraction_of_limit"] if best["fraction_of_limit"] else None
            bound = ""
            if speed < 1.5 and need is not None:
                bound = f", needs {need:.0%} of the link limit" + (": out of reach" if need > 1 else "")
            first = f"{r['first_refit_s'] * 1e3:.1f} vs {best['first_refit_s'] * 1e3:.1f} ms"
            lines.append(
                f"{layout} {r['method']}: extra memory <= swap's: {mem}; >= 1.5x swap: "
                f"{'met' if speed >= 1.5 else 'NOT met'} ({speed:.2f}x{bound}); first refit <= swap's: "
                f"{'met' if r['first_refit_s'] <= best['first_refit_s'] else 'NOT met'} ({first})"
            )
    return lines


def main(argv=None, *, rank_setup=None) -> int:
    """The benchmark; ``rank_setup`` (Python callers only): a module-level function every rank calls
    first (the CPU test installs its test-only shim there)."""
    from benchmarks.common import spec_for

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(MOE_PRESETS), default="3b")
    p.add_argument(
        "--experts",
        choices=["grouped", "sequential"],
        default=None,
        help="MoE presets: expert parameter names, TEGroupedMLP's linear_fc1.weight<K> (grouped, default: "
        "what swap_model_weights can move between EP sizes) or SequentialMLP's local_experts.<K> (sequential)",
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--world", type=int, default=0, help="ranks of the job; default: all GPUs, 4 on CPU")
    p.add_argument(
        "--layouts",
        default=None,
        help="comma-separated co:A:B (colocated) / nc:A:B (engine on the next ranks), A and B "
        "tp<N>[pp<N>][ep<N>][dp<N>] (ep: MoE presets); default: the issue's layouts for --world",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated swap:nccl|gloo|nvshmem|nixl, ours:stream|stream-zero-copy|atomic|atomic-zero-copy|"
        "atomic-host",
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--first-repeats",
        type=int,
        default=3,
        help="cold first refits per row (swap: its caches cleared; ours: a new executor), interleaved across the "
        "layout's methods after each method's first; the first refit column their median: one sample moved by up "
        "to 2x between runs on a shared host",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stream-bucket-mb", type=float, default=512)
    p.add_argument("--atomic-bucket-mb", type=float, default=256)
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument(
        "--memory-budget-mb",
        type=memory_budget,
        default="auto",
        help="ours: the most device staging any rank holds, as --refit-memory-budget-mb: auto (default, what a "
        f"refit gets: {AUTO_MEMORY_BUDGET_MB} MiB, an atomic receiver's version on the device on top), none, or "
        "a number of MiB (strict: the atomic row, which keeps the version on the device, goes without it)",
    )
    p.add_argument("--no-check-finite", action="store_true", help="ours without its NaN/Inf check per refit")
    p.add_argument("--limit-gib", type=float, default=1.0, help="payload of the link-limit measurement")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument(
        "--profile-dir",
        default=None,
        help="after the timed refits, one more per row under torch.profiler; each rank writes its chrome trace "
        "and a table of the operators of most host time here",
    )
    p.add_argument(
        "--profile-first",
        nargs="?",
        const="torch",
        default=None,
        choices=["torch", "python"],
        help="with --profile-dir: a cold first refit of our rows (plan, staging, first transfer; after one "
        "unprofiled, which pays what a process pays once) runs under a profiler too (its first_refit_s then "
        "includes the profiler's cost): torch (default: torch.profiler, operators and "
        "kernels) or python (cProfile: the host's Python functions, a text file per rank)",
    )
    p.add_argument("--out", default="refit_vs_swap.json")
    a = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    gpu = a.device == "cuda" or (a.device == "auto" and gpus >= 2)
    world = a.world or (gpus if gpu else 4)
    if gpu and gpus < world:
        p.error(f"--world {world} needs {world} GPUs, found {gpus}")
    if a.iters < 1 or a.warmup < 0 or a.first_repeats < 1:
        p.error("--iters and --first-repeats must be >= 1 and --warmup >= 0")
    if a.profile_first and not a.profile_dir:
        p.error("--profile-first writes its traces under --profile-dir: give one")
    moe = a.preset in MOE_PRESETS
    if a.experts and not moe:
        p.error(f"--experts names expert parameters: pick a MoE --preset ({', '.join(sorted(MOE_PRESETS))})")
    experts = (a.experts or "grouped") if moe else None
    num_experts = spec_for(a.preset).num_moe_experts if moe else 0
    try:
        layouts = a.layouts or ",".join(default_layouts(world, moe))
        cases = [parse_case(n.strip(), num_experts) for n in layouts.split(",")]
        methods = parse_methods(a.methods) if a.methods else available_methods(gpu)
    except ValueError as exc:
        p.error(str(exc))
    if "swap:gloo" in methods and not torch.cuda.is_available() and rank_setup is None:
        p.error(NO_DRIVER_GLOO + "; leave it out of --methods (the CPU test runs it with a test-only shim)")
    if not a.methods and not any(m.startswith("swap") for m in methods):
        print(f"note: {NO_DRIVER_GLOO}; running our rows only", flush=True)
    too_big = [c.name for c in cases if c.world > world]
    if too_big:
        p.error(f"layouts {too_big} need more than --world {world} ranks")
    opts = dict(
        iters=a.iters,
        warmup=a.warmup,
        first_repeats=a.first_repeats,
        stream_bucket=int(a.stream_bucket_mb * MiB),
        atomic_bucket=int(a.atomic_bucket_mb * MiB),
        max_inflight=a.max_inflight,
        memory_budget=None
        if a.memory_budget_mb == "none"
        else int((AUTO_MEMORY_BUDGET_MB if a.memory_budget_mb == "auto" else a.memory_budget_mb) * MiB),
        memory_budget_strict=a.memory_budget_mb != "auto",
        check_finite=not a.no_check_finite,
        limit_bytes=int(a.limit_gib * GiB),
        experts=experts,
        profile_dir=a.profile_dir,
        profile_first=a.profile_first,
    )
    backend = "nccl" if gpu else "gloo"
    print(
        f"refit vs swap_model_weights: preset {a.preset}" + (f" ({experts} experts)" if moe else "") + ", "
        f"{world} ranks ({backend}), "
        f"{len(cases)} layout(s), methods {', '.join(methods)}; median of {a.iters} after {a.warmup} warm-up(s)",
        flush=True,
    )
    res = run_on_ranks(
        _rank, world, args=(a.preset, cases, methods, opts, rank_setup), backend=backend, timeout=a.timeout_s
    )
    rows = _rows(cases, methods, res, experts)
    print_table(rows)
    verdicts = targets(rows)
    if verdicts:
        print("\ntargets (ours vs the best swap row):\n  " + "\n  ".join(verdicts))
    result = dict(
        benchmark="refit_vs_swap",
        **provenance("benchmarks/refit_vs_swap.py", argv),
        preset=a.preset,
        experts=experts,
        world=world,
        backend=backend,
        methods=methods,
        options={k: v for k, v in opts.items()},
        layouts=[dict(name=c.name, description=c.describe()) for c in cases],
        rows=rows,
        targets=verdicts,
        all_correct=all(r["correct"] for r in rows if not r["unsupported"]),
        # the copy-and-check kernel's compile (Triton), before the first layout (None: not compiled: CPU, no check)
        kernel_compile_s=res[0][0]["kernel_compile_s"] if res and res[0] else None,
        ranks=res,
    )
    if result["kernel_compile_s"] is not None:
        print(
            f"\nthe copy-and-check kernel compiled in {result['kernel_compile_s'] * 1e3:.0f} ms before the first "
            "layout (once per process, in the background from when a refit is built; not in any first refit)"
        )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"\nwrote {a.out}")
    if not result["all_correct"]:
        print("some rows gave the engine wrong weights: their times are not reported", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
