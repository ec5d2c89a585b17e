"""End-to-end training-step benchmark of NCCL symmetric-memory staging: ms/step and tokens/s of a Megatron
GPTModel trained with data parallelism over ``--world`` GPUs, Megatron DDP and experimental FSDP.

    NCCL_NVLS_ENABLE=0 python benchmarks/train_step.py --world 4 --variants plain,auto,on \
        --param-gather sync,overlap --symm-mem-bands probe --out train_step_4x.json
    NCCL_NVLS_ENABLE=0 python benchmarks/train_step.py --world 2 --symm-mem-bands probe --distopt on,off

The model: megatron-core's ``GPTModel`` on the local layer spec without Transformer Engine
(:mod:`megatron_ext.testing.tiny_llama`: RoPE, RMSNorm, SwiGLU, GQA, untied embeddings) in the shape of a
``benchmarks.common.PRESETS`` entry (default ``1b``: Llama-3.2-1B's layers, 1.50e9 parameters untied),
every parameter in bf16 (norm weights too, as megatron-core's ``Float16Module`` casts them), TP=1, every
rank a data-parallel replica. Each rank trains on its own fixed synthetic
tokens (no data loading in the step). One step is one global batch of ``--global-batch`` sequences of
``--seq`` tokens, ``--global-batch / (--world x --micro-batch)`` micro-batches per rank through megatron-core's
``get_forward_backward_func``, then the optimizer step. tokens/s = global batch x seq / step time.

Variants (``--variants``, each against the ``plain`` of its family and setting):

- Megatron DDP (``--families ddp``): ``plain`` = megatron-core's ``DistributedDataParallel``; ``auto`` / ``on`` =
  ``SymmMemDistributedDataParallel`` with ``SymmMemConfig(mode=auto|on)``; ``bands`` = auto deciding per buffer by
  its size band alone (``decide_by="bands"``, the previous auto; not run unless named in ``--variants``); the bands
  from ``--symm-mem-bands``. ``overlap_grad_reduce=True``; one setting per combination of ``--distopt``
  (distributed optimizer on/off), ``--param-gather`` (the distributed optimizer's parameter all-gather: ``sync``
  after the optimizer step, or ``overlap``: megatron-core's ``overlap_param_gather``, dispatched bucket by bucket
  behind the next forward), ``--grad-reduce`` (gradients accumulated and reduced in fp32 or bf16) and
  ``--bucket-mib`` (bucket size in MiB of gradients, or ``megatron``: megatron-core's default of max(40M, 1M x DP)
  elements);
  ``get_megatron_optimizer`` (Adam, bf16 with fp32 main parameters, gradient clipping 1.0: megatron-core's
  defaults).
- Experimental FSDP (``--families fsdp``; megatron-core's ``megatron_fsdp.experimental``): ``plain`` = upstream
  ``fully_shard``; ``upstream-symm`` = upstream ``fully_shard(use_symm_mem=True)``; ``auto`` / ``on`` / ``bands``
  = our ``megatron_ext.fsdp_symm.fully_shard`` with the configs above. Applied bottom-up as
  upstream expects (a module's parameters belong to the innermost sharded module): every transformer layer,
  the embedding, the output layer, then the GPTModel itself (the root, owning the final norm, whose forward
  and backward hooks order the prefetches of all of them). Flat placements (plain FSDP over all ranks),
  ``MixedPrecisionPolicy(main_params_dtype=float32)``: bf16 compute weights and gradients (all-gathers and
  reduce-scatters in bf16), fp32 main weights; ``torch.optim.AdamW`` with ``fully_shard_optimizer``. Every
  micro-batch's backward reduce-scatters (upstream's plain-FSDP semantics).

``auto`` decides by the training step (docs/fsdp_symm.md, "auto decided by the step"): its job first trains
through the A/B (``SymmMemConfig``'s ``ab_*`` schedule, about 60 steps; a cache entry skips it: ``--symm-mem-cache``
defaults to a fresh file per run, so every run decides again), then times the arm it kept like every other
variant; the row's ``ab`` says what the A/B timed and chose.

Each variant runs in its own job (``run_on_ranks``, NCCL, ``--world`` fresh processes): every variant starts
from the same state (fresh CUDA caching allocator and NCCL communicators, no symmetric windows or pool
segments left by an earlier variant, which a staged variant would reuse and a plain one could not use, nothing
earlier in the process to warm it up), at the price of about 10-15 s of start-up per job.

Per variant: ms/step (``--reps`` repetitions of ``--steps`` back-to-back steps after ``--warmup`` untimed
steps, each repetition after a device sync and a barrier, timed with CUDA events; a repetition's time is the
slowest rank's; median, min, max), tokens/s, speed-up against plain (plain's ms/step / the variant's: the
tokens/s ratio), peak memory (``torch.cuda.max_memory_allocated`` over the steps, the model's persistent
state included, largest rank; the symmetric pool's blocks are the caching allocator's too), the collective
buffers staged symmetric (DDP: each bucket's gradient reduce and, with the distributed optimizer, parameter
all-gather; FSDP: each parameter group's all-gather and reduce-scatter; upstream ``use_symm_mem`` puts one
side of every collective in the pool, shown as ``1-side``), and one profiled step
(``benchmarks.symm_mem.profile_step``): NCCL kernels and how many were symmetric (``ncclSymk``), their summed
time, and the exposed communication: the time in which the GPU ran an NCCL kernel and nothing else (largest
rank). Exposed communication is what staging can shorten directly; NCCL kernel time hidden behind compute
only matters through contention, which this does not measure, and a kernel's time includes waiting for a
slower peer. The summary says per staged variant whether it met the targets (>= 3% more tokens/s than
plain; never more than 1% slower), and otherwise how much of the step is exposed communication; then per family
and setting ``auto`` vs ``on`` vs plain and one verdict line per target of the issue: ``auto >= max(on, plain) -
1%``; FSDP ``auto >= +12%`` (set for 4 ranks and the 1b preset); DDP ``auto >= +3%``, or where it falls short the
communication the staging could shorten (the exposed share of the rank that waits least) and where that is
explained (docs/fsdp_symm.md).

Prints a table, writes JSON (``--out``: provenance, the shape and batch, every variant with its per-rank
profile and memory, the bands auto used). Needs ``--world`` CUDA GPUs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import GiB, PRESETS, int_at_least, megatron_config, provenance  # noqa: E402
from benchmarks.symm_mem import profile_step, step_stats  # noqa: E402
from megatron_ext.testing import tiny_gpt, tiny_llama  # noqa: E402

MIB = 1 << 20
FAMILIES = ("ddp", "fsdp")
VARIANT_NAMES = ("plain", "upstream-symm", "bands", "auto", "on")
DEFAULT_VARIANTS = ("plain", "upstream-symm", "auto", "on")
FAMILY_VARIANTS = {"ddp": ("plain", "bands", "auto", "on"), "fsdp": ("plain", "upstream-symm", "bands", "auto", "on")}
LABELS = {
    ("ddp", "plain"): "Megatron DDP",
    ("ddp", "bands"): "ours (bands)",
    ("ddp", "auto"): "ours (auto)",
    ("ddp", "on"): "ours (on)",
    ("fsdp", "plain"): "upstream plain",
    ("fsdp", "upstream-symm"): "upstream use_symm_mem",
    ("fsdp", "bands"): "ours (bands)",
    ("fsdp", "auto"): "ours (auto)",
    ("fsdp", "on"): "ours (on)",
}
FSDP_SETTING = "per-layer units, bf16 grads"  # see the module docstring
DEFAULT_SEQ = {"tiny": 128}  # other presets: 2048
GAIN_TARGET_PCT = 3.0  # the issue's target: >= 3% more tokens/s than plain where communication is exposed
LOSS_LIMIT_PCT = 1.0  # ... and never more than 1% slower
# Issue 31's targets: auto >= max(on, plain) - 1%; FSDP auto >= +12% at 4 ranks on the 1b preset; DDP auto >= +3%
# or the explanation (docs/fsdp_symm.md, "DDP: why the staging does not move the step").
AUTO_TOLERANCE_PCT = 1.0
FSDP_AUTO_TARGET = dict(pct=12.0, world=4, preset="1b")
DDP_AUTO_TARGET_PCT = 3.0
DDP_EXPLANATION = "docs/fsdp_symm.md#ddp-why-the-staging-does-not-move-the-step"
AB_MAX_STEPS = 500  # the auto job's A/B must decide within this many steps
JOB_TIMEOUT_S = 300
_PROFILE_KEYS = ("nccl_kernels", "symk_kernels", "nccl_kernel_us", "nccl_busy_us", "exposed_nccl_us", "gpu_busy_us")


# ------------------------------------------------------------------------------------------ one rank
def _symm_config(variant: str, bands: str, cache: str | None = None):
    """Our variants' SymmMemConfig; None for upstream's. ``cache``: the band and step-A/B cache file."""
    from megatron_ext.fsdp_symm import SymmMemConfig

    if variant == "auto":
        return SymmMemConfig(mode="auto", bands=bands, report=False, probe_cache=cache)
    if variant == "bands":
        return SymmMemConfig(mode="auto", decide_by="bands", bands=bands, report=False, probe_cache=cache)
    if variant == "on":
        return SymmMemConfig(mode="on", report=False)
    return None


def _bands_used(config, group, device) -> dict | None:
    """The bands auto mode decides ``group``'s buffers with (MiB), resolved as staging resolves them (once per
    group of ranks per process: staging reuses this probe)."""
    from megatron_ext.fsdp_symm import COLLECTIVES, resolve_config

    if config is None or config.mode != "auto":
        return None
    used = resolve_config(config, group, device)
    return {
        c: {"bf16": [b / MIB for b in used.band(c)], "fp32": [b / MIB for b in used.band(c, "float32")]}
        for c in COLLECTIVES
    }


def _decision_rows(pairs) -> list[dict]:
    return [
        dict(name=n, collective=d.collective, mib=d.nbytes / MIB, symmetric=d.symmetric, reason=d.reason)
        for n, d in pairs
    ]


def _build_ddp(module, cfg, item, bands, device, cache=None):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.fsdp_symm import SymmMemDistributedDataParallel, release_symmetric_memory

    setting, variant = item["setting"], item["variant"]
    fp32 = setting["grad_reduce"] == "fp32"
    bucket = setting["bucket_mib"]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp32,
        use_distributed_optimizer=setting["distopt"],
        overlap_grad_reduce=True,
        overlap_param_gather=setting["distopt"] and setting.get("param_gather", "sync") == "overlap",
        bucket_size=None if bucket is None else max(1, int(bucket * MIB) // (4 if fp32 else 2)),
    )
    symm = _symm_config(variant, bands, cache)
    bands_used = _bands_used(symm, ps.get_data_parallel_group(), device)
    if symm is None:
        ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=module)
    else:
        ddp = SymmMemDistributedDataParallel(config=cfg, ddp_config=ddp_config, module=module, symm_mem_config=symm)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=setting["distopt"],
        ),
        [ddp],
    )
    cfg.no_sync_func = ddp.no_sync
    cfg.grad_scale_func = opt.scale_loss
    cfg.finalize_model_grads_func = finalize_model_grads

    def zero():
        ddp.zero_grad_buffer()
        opt.zero_grad()

    buckets = [b for buffer in ddp.buffers for b in buffer.buckets]

    def info():  # after the steps: the A/B's choice is staged by then
        decisions = getattr(ddp, "symm_mem_decisions", None)
        if decisions is None:  # plain: every bucket's grad reduce, and its param all-gather with the distopt
            staged = dict(symmetric=0, total=len(buckets) * (2 if setting["distopt"] else 1), one_side=False)
        else:
            staged = dict(symmetric=sum(d.symmetric for _, d in decisions), total=len(decisions), one_side=False)
        return dict(
            staged=staged,
            decisions=_decision_rows(decisions or []),
            bands=bands_used,
            bucket_mib=[b.grad_data.numel() * b.grad_data.element_size() / MIB for b in buckets],
        )

    release = (lambda: release_symmetric_memory(ddp)) if symm is not None else (lambda: 0)
    return ddp, opt, zero, info, release


def _build_fsdp(module, cfg, item, bands, device, cache=None):
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MixedPrecisionPolicy
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import (
        Flat,
        Placements,
        fully_shard_optimizer,
    )
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import fully_shard as upstream_fully_shard
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.module import FsdpModule
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_ext.fsdp_symm import fully_shard, release_symmetric_memory

    variant = item["variant"]
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    placements = Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
    mp = MixedPrecisionPolicy(main_params_dtype=torch.float32)
    symm = _symm_config(variant, bands, cache)
    upstream_symm = variant == "upstream-symm"
    bands_used = _bands_used(symm, mesh.get_group(0), device)
    # Bottom-up: each module owns the parameters no sharded descendant owns; the root last.
    for unit in [*module.decoder.layers, module.embedding, module.output_layer, module]:
        if symm is None:
            upstream_fully_shard(
                unit, mesh=mesh, placements=placements, mixed_precision_policy=mp, use_symm_mem=upstream_symm
            )
        else:
            fully_shard(unit, mesh=mesh, placements=placements, mixed_precision_policy=mp, symm_mem_config=symm)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    fully_shard_optimizer(opt)

    def zero():
        opt.zero_grad(set_to_none=True)

    groups = [g for m in module.modules() if isinstance(m, FsdpModule) for g in m.parameter_groups]

    def info():  # after the steps: the A/B's choice is staged by then
        pairs = [
            (f"{name or 'root'}/group{i} {d.collective}", d)
            for name, m in module.named_modules()
            if hasattr(m, "symm_decisions")
            for i, (_, ag, rs) in enumerate(m.symm_decisions())
            for d in (ag, rs)
        ]
        staged = dict(
            symmetric=sum(d.symmetric for _, d in pairs),
            total=sum(1 + g.requires_grad for g in groups),
            one_side=upstream_symm,
        )
        return dict(staged=staged, decisions=_decision_rows(pairs), bands=bands_used, units=len(groups))

    release = (lambda: release_symmetric_memory(module)) if symm is not None else (lambda: 0)
    return module, opt, zero, info, release


def variant_rank(item: dict, shape: dict, batch: dict, timing: dict, bands: str, cache: str | None = None) -> dict:
    """One rank of one variant's job: build, train until auto's step A/B has decided (auto only), train
    ``timing`` steps, profile one; this rank's numbers."""
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel()
    device = tiny_gpt.rank_device()
    gpu = device.type == "cuda"
    spec = tiny_llama.TinyLlamaSpec(**shape)
    cfg = megatron_config(spec, gpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        # Every parameter in bf16, the norm weights too (as megatron-core's Float16Module casts them).
        module = tiny_llama.build_model(spec, cfg, device=device).bfloat16()
        parameters = sum(p.numel() for p in module.parameters())
        build = _build_ddp if item["family"] == "ddp" else _build_fsdp
        model, opt, zero, info, release = build(module, cfg, item, bands, device, cache)
        if gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        built_bytes = torch.cuda.memory_allocated(device) if gpu else 0

        seq, mb, n = batch["seq"], batch["micro_batch"], batch["microbatches"]
        gen = torch.Generator().manual_seed(1000 + dist.get_rank())
        data = torch.randint(0, spec.vocab_size, (n, mb, seq + 1), generator=gen).to(device)
        micro = [(data[i, :, :-1].contiguous(), data[i, :, 1:].contiguous()) for i in range(n)]
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mb, seq)
        attention_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
        num_tokens = torch.tensor(mb * seq, dtype=torch.int, device=device)
        forward_backward = get_forward_backward_func()

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            per_token = model(tokens, position_ids, attention_mask, labels=labels)

            def loss(output):
                total = output.float().sum()
                # Megatron divides the returned loss in place: report a copy.
                return total, num_tokens, {"loss": total.detach().clone()}

            return per_token, loss

        losses = []

        def step():
            zero()
            out = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[model],
                num_microbatches=n,
                seq_length=seq,
                micro_batch_size=mb,
            )
            opt.step()
            losses.append(torch.stack([o["loss"] for o in out]).sum() / (n * mb * seq))

        ab = _run_step_ab(step, model) if item["variant"] == "auto" else None
        stats = step_stats(step, timing["steps"], timing["reps"], warmup=timing["warmup"])
        reps = torch.tensor(stats["ms_reps"], dtype=torch.float64, device=device)
        dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # a repetition takes as long as its slowest rank
        # Without CUDA (gloo ranks) there are no kernels to profile.
        profile = profile_step(step) if gpu else dict.fromkeys(_PROFILE_KEYS, 0)
        peak = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)) if gpu else (0, 0)
        info = info()
        released = release()
    return dict(
        ab=ab,
        rank=dist.get_rank(),
        parameters=parameters,
        ms_reps=reps.tolist(),
        profile=profile,
        built_bytes=built_bytes,
        peak_bytes=peak[0],
        peak_reserved_bytes=peak[1],
        released_bytes=released,
        loss_first=losses[0].item(),
        loss_last=losses[-1].item(),
        warnings=sorted({str(w.message)[:400] for w in caught if issubclass(w.category, RuntimeWarning)}),
        **info,
    )


def _run_step_ab(step, model) -> dict:
    """Train until auto's step A/B (megatron_ext.fsdp_symm.step_ab_of) has decided, or found its choice in the
    cache; what it did, with the steps and seconds it took here."""
    import torch.distributed as dist

    from megatron_ext.fsdp_symm import step_ab_of

    start, steps = time.perf_counter(), 0
    ab = None
    while steps < AB_MAX_STEPS:
        step()
        steps += 1
        ab = step_ab_of(model)
        if ab is None or ab.state != "running":
            break
    if ab is not None and ab.state == "running":
        raise RuntimeError(f"the step A/B did not decide in {AB_MAX_STEPS} steps: {ab.summary()}")
    if dist.is_initialized():
        dist.barrier()
    if ab is None:
        return dict(state="none", arm=None, job_steps=steps, job_s=time.perf_counter() - start)
    return dict(ab.summary(), job_steps=steps, job_s=time.perf_counter() - start)


# ------------------------------------------------------------------------------------- the summary
def parameter_count(shape: dict) -> int:
    """Parameters of the Llama-shaped GPTModel of ``shape`` (TinyLlamaSpec fields; untied embeddings, no
    biases): per layer QKV (GQA), output projection, SwiGLU fc1 (gate and up) and fc2, two RMSNorms; the
    embedding, the output layer and the final norm."""
    h, f, v = shape["hidden_size"], shape["ffn_hidden_size"], shape["vocab_size"]
    kv = shape["num_query_groups"] * (h // shape["num_attention_heads"])
    layer = h * (h + 2 * kv) + h * h + h * 2 * f + f * h + 2 * h
    return shape["num_layers"] * layer + 2 * v * h + h


def row_from_ranks(item: dict, ranks: list[dict]) -> dict:
    """One table row from every rank's result: timing (already the slowest rank's per repetition), the
    largest rank's memory and exposed communication, rank 0's kernel counts, staging and decisions."""
    r0 = ranks[0]
    ms = r0["ms_reps"]
    prof = [r["profile"] for r in ranks]
    return dict(
        _item_fields(item),
        parameters=r0["parameters"],
        ms_per_step=statistics.median(ms),
        ms_min=min(ms),
        ms_max=max(ms),
        ms_reps=ms,
        nccl_kernels=prof[0]["nccl_kernels"],
        symk_kernels=prof[0]["symk_kernels"],
        nccl_kernel_ms=max(p["nccl_kernel_us"] for p in prof) / 1e3,
        nccl_busy_ms=max(p["nccl_busy_us"] for p in prof) / 1e3,
        exposed_comm_ms=max(p["exposed_nccl_us"] for p in prof) / 1e3,
        # The rank that waits least inside NCCL kernels: its NCCL time is closest to the transfers themselves.
        nccl_kernel_min_ms=min(p["nccl_kernel_us"] for p in prof) / 1e3,
        exposed_comm_min_ms=min(p["exposed_nccl_us"] for p in prof) / 1e3,
        gpu_busy_ms=max(p["gpu_busy_us"] for p in prof) / 1e3,
        peak_gib=max(r["peak_bytes"] for r in ranks) / GiB,
        peak_reserved_gib=max(r["peak_reserved_bytes"] for r in ranks) / GiB,
        built_gib=max(r["built_bytes"] for r in ranks) / GiB,
        symmetric_buffers=r0["staged"]["symmetric"],
        collective_buffers=r0["staged"]["total"],
        one_side=r0["staged"]["one_side"],
        released_mib=r0["released_bytes"] / MIB,
        bands=r0["bands"],
        decisions=r0["decisions"],
        bucket_mib=r0.get("bucket_mib"),
        fsdp_groups=r0.get("units"),
        loss_first=r0["loss_first"],
        loss_last=r0["loss_last"],
        ab=r0.get("ab"),
        warnings=sorted({w for r in ranks for w in r["warnings"]}),
        per_rank=[dict(rank=r["rank"], profile=r["profile"], peak_bytes=r["peak_bytes"]) for r in ranks],
    )


def _item_fields(item: dict) -> dict:
    return dict(
        family=item["family"],
        variant=item["variant"],
        name=LABELS[item["family"], item["variant"]],
        setting=item["setting_label"],
        setting_fields=item["setting"],
    )


def summarize(rows: list[dict], tokens_per_step: int) -> list[dict]:
    """``rows`` with tokens/s (``tokens_per_step`` per median step), the speed-up against the plain variant
    of the same family and setting (plain's ms/step / the row's, = the tokens/s ratio; and in %), and the
    exposed communication and NCCL kernel time as shares of the step. Rows without a time (failed jobs) stay
    as they are."""
    plain = {(r["family"], r["setting"]): r for r in rows if r["variant"] == "plain" and "ms_per_step" in r}
    for r in rows:
        if "ms_per_step" not in r:
            continue
        r["tokens_per_s"] = tokens_per_step / (r["ms_per_step"] / 1e3)
        base = plain.get((r["family"], r["setting"]))
        r["speedup"] = base["ms_per_step"] / r["ms_per_step"] if base else None
        r["speedup_pct"] = 100.0 * (r["speedup"] - 1.0) if base else None
        # Do the repetitions' ranges of the row and of plain overlap (the difference is within their spread)?
        r["overlaps_plain"] = bool(base) and not (r["ms_max"] < base["ms_min"] or r["ms_min"] > base["ms_max"])
        r["exposed_comm_share"] = r["exposed_comm_ms"] / r["ms_per_step"]
        r["nccl_kernel_share"] = r["nccl_kernel_ms"] / r["ms_per_step"]
    return rows


def verdict(row: dict) -> str:
    """The issue's targets for a staged variant: >= 3% more tokens/s than plain; never more than 1% slower;
    where there is no gain, how much of the step is exposed communication and how much was staged."""
    if "speedup_pct" not in row or row["speedup_pct"] is None:
        return "no time (job failed)" if "error" in row else "no plain baseline"
    pct = row["speedup_pct"]
    spread = " (within the repetitions' spread)" if row["overlaps_plain"] else ""
    if pct >= GAIN_TARGET_PCT:
        return f"{pct:+.1f}% tokens/s{spread}: meets the >= {GAIN_TARGET_PCT:g}% target"
    why = (
        f"exposed communication {100 * row['exposed_comm_share']:.1f}% of the step, "
        f"{row['symmetric_buffers']}/{row['collective_buffers']} buffers symmetric"
    )
    if pct < -LOSS_LIMIT_PCT:
        return f"{pct:+.1f}% tokens/s{spread}: more than {LOSS_LIMIT_PCT:g}% slower than plain; {why}"
    return (
        f"{pct:+.1f}% tokens/s{spread}: below the {GAIN_TARGET_PCT:g}% target, "
        f"not more than {LOSS_LIMIT_PCT:g}% slower; {why}"
    )


def _pct(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def target_verdicts(rows: list[dict], world: int, preset: str) -> list[dict]:
    """Issue 31's targets, per family and setting that has a plain and an auto row: ``auto >= max(on, plain) -
    1%`` (tokens/s); FSDP ``auto >= +12%`` over plain (set for 4 ranks and the 1b preset: elsewhere reported,
    not judged); DDP ``auto >= +3%`` over plain, or where it falls short the measured reason beside the
    explanation in the docs. Each entry: family, setting, target, value (%), met (True, False or None: not
    judged here), text (one printed line)."""
    out = []
    keys = list(dict.fromkeys((r["family"], r["setting"]) for r in rows))
    for family, setting in keys:
        by = {r["variant"]: r for r in rows if (r["family"], r["setting"]) == (family, setting) and "tokens_per_s" in r}
        plain, auto, on = by.get("plain"), by.get("auto"), by.get("on")
        if plain is None or auto is None:
            continue
        arm = (auto.get("ab") or {}).get("arm") or "?"

        def entry(target, value, met, text):
            out.append(dict(family=family, setting=setting, target=target, value=value, met=met, text=text))

        best, best_name = plain["tokens_per_s"], "plain"
        if on is not None and on["tokens_per_s"] > best:
            best, best_name = on["tokens_per_s"], "on"
        rel = _pct(auto["tokens_per_s"], best)
        met = rel >= -AUTO_TOLERANCE_PCT
        on_text = "no on row" if on is None else f"on {on['tokens_per_s']:.0f} ({on['speedup_pct']:+.1f}%)"
        entry(
            f"auto >= max(on, plain) - {AUTO_TOLERANCE_PCT:g}%",
            rel,
            met,
            f"auto >= max(on, plain) - {AUTO_TOLERANCE_PCT:g}%: {'met' if met else 'NOT met'}: auto "
            f"{auto['tokens_per_s']:.0f} tokens/s ({auto['speedup_pct']:+.1f}% vs plain, the A/B kept {arm}), "
            f"{rel:+.1f}% vs {best_name}; plain {plain['tokens_per_s']:.0f}, {on_text}",
        )
        gain = auto["speedup_pct"]
        if family == "fsdp":
            t = FSDP_AUTO_TARGET
            where = f"{t['world']} ranks, {t['preset']} preset"
            judged = world == t["world"] and preset == t["preset"]
            met = (gain >= t["pct"]) if judged else None
            if judged:
                status = "met" if met else "NOT met"
            else:
                status = f"not judged (set for {where}; this run: {world} ranks, {preset} preset)"
            target = f"FSDP auto >= +{t['pct']:g}% ({where})"
            entry(target, gain, met, f"{target}: {status}: {gain:+.1f}%")
        if family == "ddp":
            met = gain >= DDP_AUTO_TARGET_PCT
            target = f"DDP auto >= +{DDP_AUTO_TARGET_PCT:g}%"
            if met:
                text = f"{target}: met: {gain:+.1f}%"
            else:
                share = 100 * auto["exposed_comm_min_ms"] / auto["ms_per_step"]
                text = (
                    f"{target}: NOT met ({gain:+.1f}%); explained in {DDP_EXPLANATION}: the rank that waits "
                    f"least has {auto['exposed_comm_min_ms']:.1f} ms ({share:.1f}% of the step) of exposed NCCL "
                    f"time and {auto['nccl_kernel_min_ms']:.1f} ms in NCCL kernels (plain "
                    f"{plain['nccl_kernel_min_ms']:.1f} ms), the most any staging could shorten"
                )
                if on is not None:
                    text += f"; on: {on['nccl_kernel_min_ms']:.1f} ms"
            entry(f"{target} or explained", gain, met, text)
    return out


def print_table(rows: list[dict], world: int) -> None:
    head = (
        f"{'family':<6} {'setting':<42} {'variant':<22} {'ms/step [min, max]':>24} {'tokens/s':>10} "
        f"{'vs plain':>9} {'peak GiB':>8} {'symm buffers':>12} {'symk/nccl':>10} {'NCCL ms':>8} "
        f"{'exposed ms':>10} {'% step':>6}"
    )
    print(f"\n{world} ranks\n{head}\n{'-' * len(head)}")
    for r in rows:
        first = f"{r['family']:<6} {r['setting']:<42} {r['name']:<22}"
        if "ms_per_step" not in r:
            print(f"{first} failed: {r.get('error', '')[-200:]!r}")
            continue
        ms = f"{r['ms_per_step']:.2f} [{r['ms_min']:.2f}, {r['ms_max']:.2f}]"
        vs = "" if r["speedup_pct"] is None or r["variant"] == "plain" else f"{r['speedup_pct']:+.1f}%"
        symm = "1-side" if r["one_side"] else f"{r['symmetric_buffers']}/{r['collective_buffers']}"
        kernels = f"{r['symk_kernels']}/{r['nccl_kernels']}"
        print(
            f"{first} {ms:>24} {r['tokens_per_s']:>10.0f} {vs:>9} {r['peak_gib']:>8.1f} {symm:>12} {kernels:>10} "
            f"{r['nccl_kernel_ms']:>8.2f} {r['exposed_comm_ms']:>10.2f} {100 * r['exposed_comm_share']:>5.1f}%"
        )


# ------------------------------------------------------------------------------------------ flags


def _choice_list(allowed):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(","))
        bad = [v for v in values if v not in allowed]
        if bad or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of distinct values from {', '.join(allowed)}; got {text!r}"
            )
        return values

    return parse


def _bucket_list(text: str) -> tuple[float | None, ...]:
    out = []
    for v in text.split(","):
        v = v.strip()
        if v == "megatron":
            out.append(None)
            continue
        try:
            mib = float(v)
        except ValueError:
            mib = math.nan
        if not (math.isfinite(mib) and mib > 0):
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of bucket sizes in MiB (> 0) or 'megatron' "
                f"(megatron-core's default bucket); got {text!r}"
            )
        out.append(mib)
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"bucket sizes must be distinct; got {text!r}")
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="data-parallel ranks, one GPU each (default 2)")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="1b",
        help="model shape from benchmarks/common.py (default 1b: Llama-3.2-1B's shape); the flags below override it",
    )
    for flag, field in (
        ("hidden", "hidden_size"),
        ("layers", "num_layers"),
        ("heads", "num_attention_heads"),
        ("query-groups", "num_query_groups"),
        ("ffn", "ffn_hidden_size"),
        ("vocab", "vocab_size"),
    ):
        parser.add_argument(f"--{flag}", type=int_at_least(1), default=None, help=f"{field} (default: the preset's)")
    parser.add_argument("--seq", type=int_at_least(1), default=None, help="sequence length (default 2048; tiny: 128)")
    parser.add_argument("--micro-batch", type=int_at_least(1), default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument(
        "--global-batch",
        type=int_at_least(1),
        default=None,
        help="sequences per step over all ranks, a multiple of --world x --micro-batch (default: one micro-batch "
        "per rank)",
    )
    parser.add_argument(
        "--families", type=_choice_list(FAMILIES), default=FAMILIES, help="comma list of ddp, fsdp (default both)"
    )
    parser.add_argument(
        "--variants",
        type=_choice_list(VARIANT_NAMES),
        default=DEFAULT_VARIANTS,
        help="comma list of plain, upstream-symm (FSDP only), bands (auto by the bands alone), auto, on (default "
        "plain,upstream-symm,auto,on; plain is required)",
    )
    parser.add_argument(
        "--distopt", type=_choice_list(("on", "off")), default=("on",), help="DDP: distributed optimizer, comma list"
    )
    parser.add_argument(
        "--param-gather",
        type=_choice_list(("sync", "overlap")),
        default=("sync",),
        help="DDP with the distributed optimizer: its parameter all-gather after the optimizer step (sync) or "
        "overlapped with the next forward (overlap: overlap_param_gather), comma list (default sync)",
    )
    parser.add_argument(
        "--grad-reduce",
        type=_choice_list(("fp32", "bf16")),
        default=("fp32",),
        help="DDP: gradients accumulated and reduced in fp32 (grad_reduce_in_fp32) or bf16, comma list",
    )
    parser.add_argument(
        "--bucket-mib",
        type=_bucket_list,
        default=(16.0,),
        help="DDP: bucket size in MiB of gradients, or megatron (max(40M, 1M x DP) elements), comma list (default 16)",
    )
    parser.add_argument(
        "--symm-mem-bands",
        choices=("measured", "probe"),
        default="measured",
        help="auto mode's bands: measured (shipped, 2 ranks) or probe (measured at start-up on these ranks, cached)",
    )
    parser.add_argument(
        "--symm-mem-cache",
        default=None,
        metavar="PATH",
        help="the band and step-A/B cache file of the auto variants (default: a fresh file per run, so the probe "
        "and the A/B run in every run; give a path to reuse their results)",
    )
    parser.add_argument("--steps", type=int_at_least(1), default=10, help="timed steps per repetition (default 10)")
    parser.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed steps first (default 3)")
    parser.add_argument("--reps", type=int_at_least(1), default=5, help="timed repetitions (default 5)")
    parser.add_argument("--job-timeout", type=int_at_least(1), default=JOB_TIMEOUT_S, help="seconds per variant's job")
    parser.add_argument("--out", default="train_step.json")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the flags; refuses (exit 2, naming the flag) bad values, then too few GPUs."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error(f"--world must be >= 2 (data-parallel ranks, one GPU each); got {args.world}")
    preset = PRESETS[args.preset]
    shape = {k: preset[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups")}
    shape.update(ffn_hidden_size=preset["ffn_hidden_size"], vocab_size=preset["vocab_size"])
    for flag, field in (
        ("hidden", "hidden_size"),
        ("layers", "num_layers"),
        ("heads", "num_attention_heads"),
        ("query_groups", "num_query_groups"),
        ("ffn", "ffn_hidden_size"),
        ("vocab", "vocab_size"),
    ):
        if getattr(args, flag) is not None:
            shape[field] = getattr(args, flag)
    h, heads, groups = shape["hidden_size"], shape["num_attention_heads"], shape["num_query_groups"]
    if h % heads:
        parser.error(f"--hidden {h} must be a multiple of --heads {heads}")
    if heads % groups:
        parser.error(f"--heads {heads} must be a multiple of --query-groups {groups}")
    args.seq = args.seq or DEFAULT_SEQ.get(args.preset, 2048)
    shape.update(arch="llama", hf_vocab_size=shape["vocab_size"], seq_length=args.seq)
    args.shape = shape
    unit = args.world * args.micro_batch
    args.global_batch = args.global_batch or unit
    if args.global_batch % unit:
        parser.error(
            f"--global-batch {args.global_batch} must be a multiple of --world {args.world} x --micro-batch "
            f"{args.micro_batch} = {unit}"
        )
    args.microbatches = args.global_batch // unit
    if "plain" not in args.variants:
        parser.error(f"--variants must include plain (speed-ups are against it); got {','.join(args.variants)}")
    gpus = torch.cuda.device_count()
    if gpus < args.world:
        parser.error(
            f"--world {args.world} needs {args.world} CUDA GPUs (one NCCL rank per GPU); {gpus} visible: "
            f"run on a machine with {args.world} GPUs or lower --world"
        )
    return args


def plan(args) -> list[dict]:
    """The variants to run, each one job: DDP per setting (distopt x grad-reduce x bucket), then FSDP."""
    items = []
    if "ddp" in args.families:
        combos = itertools.product(args.distopt, args.param_gather, args.grad_reduce, args.bucket_mib)
        for distopt, gather, grad, bucket in combos:
            if distopt == "off" and gather == "overlap":
                continue  # no parameter all-gather without the distributed optimizer
            setting = dict(distopt=distopt == "on", grad_reduce=grad, bucket_mib=bucket, param_gather=gather)
            label = f"distopt {distopt}, {grad} grads, " + (
                "megatron buckets" if bucket is None else f"{bucket:g} MiB buckets"
            )
            label += ", overlapped param gather" if gather == "overlap" else ""
            for v in FAMILY_VARIANTS["ddp"]:
                if v in args.variants:
                    items.append(dict(family="ddp", variant=v, setting=setting, setting_label=label))
    if "fsdp" in args.families:
        for v in FAMILY_VARIANTS["fsdp"]:
            if v in args.variants:
                items.append(dict(family="fsdp", variant=v, setting={}, setting_label=FSDP_SETTING))
    return items


# ------------------------------------------------------------------------------------------ driver
def main(argv=None) -> int:
    from megatron_ext.testing.multirank import RankFailure, run_on_ranks

    import tempfile

    args = parse_args(argv)
    items = plan(args)
    cache = args.symm_mem_cache or os.path.join(tempfile.mkdtemp(prefix="train_step_"), "symm_mem_cache.json")
    tokens = args.global_batch * args.seq
    params = parameter_count(args.shape)
    print(
        f"train_step: {args.world} ranks, {torch.cuda.get_device_name()}; GPTModel {args.preset} "
        f"({params / 1e9:.3f}e9 parameters: hidden {args.shape['hidden_size']}, {args.shape['num_layers']} layers, "
        f"{args.shape['num_attention_heads']} heads / {args.shape['num_query_groups']} query groups, ffn "
        f"{args.shape['ffn_hidden_size']}, vocab {args.shape['vocab_size']}), bf16; seq {args.seq}, global batch "
        f"{args.global_batch} = {args.world} ranks x {args.microbatches} micro-batches x {args.micro_batch}; "
        f"{len(items)} jobs; auto bands: {args.symm_mem_bands}",
        flush=True,
    )
    result = dict(
        provenance=provenance("benchmarks/train_step.py", argv),
        world=args.world,
        nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
        model=dict(preset=args.preset, parameters=params, **args.shape),
        batch=dict(
            seq=args.seq,
            micro_batch=args.micro_batch,
            global_batch=args.global_batch,
            microbatches_per_rank=args.microbatches,
            tokens_per_step=tokens,
        ),
        timing=dict(steps=args.steps, warmup=args.warmup, reps=args.reps),
        symm_mem_bands=args.symm_mem_bands,
        symm_mem_cache=cache,
        targets=dict(
            gain_pct=GAIN_TARGET_PCT,
            loss_limit_pct=LOSS_LIMIT_PCT,
            auto_tolerance_pct=AUTO_TOLERANCE_PCT,
            fsdp_auto=FSDP_AUTO_TARGET,
            ddp_auto_pct=DDP_AUTO_TARGET_PCT,
        ),
        rows=[],
    )
    batch = dict(seq=args.seq, micro_batch=args.micro_batch, microbatches=args.microbatches)
    timing = dict(steps=args.steps, warmup=args.warmup, reps=args.reps)
    for item in items:
        t0 = time.perf_counter()
        try:
            ranks = run_on_ranks(
                variant_rank,
                args.world,
                args=(item, args.shape, batch, timing, args.symm_mem_bands, cache),
                backend="nccl",
                timeout=args.job_timeout,
            )
            row = row_from_ranks(item, ranks)
        except RankFailure as exc:
            row = dict(_item_fields(item), error=str(exc)[-6000:])
        row["wall_s"] = time.perf_counter() - t0
        result["rows"].append(row)
        summarize(result["rows"], tokens)
        if "error" in row:
            print(f"[{row['family']} | {row['setting']} | {row['name']}] failed:\n{row['error']}", flush=True)
        else:
            ab = row.get("ab") or {}
            kept = f"; A/B ({ab.get('state')}): {ab.get('arm')}" if ab else ""
            print(
                f"[{row['family']} | {row['setting']} | {row['name']}] {row['ms_per_step']:.2f} ms/step "
                f"[{row['ms_min']:.2f}, {row['ms_max']:.2f}], {row['tokens_per_s']:.0f} tokens/s, "
                f"exposed communication {row['exposed_comm_ms']:.2f} ms{kept}; job {row['wall_s']:.0f} s",
                flush=True,
            )
        _write(result, args.out)  # after every job: a later failure or timeout keeps the rows so far

    rows = result["rows"]
    print_table(rows, args.world)
    lines = []
    for r in rows:
        if r["variant"] in ("auto", "on"):
            lines.append(f"{r['family']} | {r['setting']} | {r['name']}: {verdict(r)}")
    print("\ntargets (staged variants vs plain):\n" + "\n".join(f"  {line}" for line in lines))
    issue = target_verdicts(rows, args.world, args.preset)
    print("\nauto vs on vs plain (issue 31):")
    for key in dict.fromkeys((v["family"], v["setting"]) for v in issue):
        print(f"  {key[0]} | {key[1]}")
        print("\n".join(f"    {v['text']}" for v in issue if (v["family"], v["setting"]) == key))
    for r in rows:
        if r.get("ab") and r["ab"].get("choice"):
            print(f"  {r['family']} | {r['setting']} | auto's A/B: {r['ab']['choice']['reason']}")
    result["target_verdicts"] = issue
    result["verdicts"] = lines + [f"{v['family']} | {v['setting']} | {v['text']}" for v in issue]
    _write(result, args.out)
    print(f"wrote {args.out} ({sum(r['wall_s'] for r in rows):.0f} s in {len(rows)} jobs)")
    return 1 if any("error" in r for r in rows) else 0


def _write(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
