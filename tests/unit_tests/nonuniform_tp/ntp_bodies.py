"""The rank body of the NTP multi-rank tests (module-level so that spawned
ranks can import it): an NTP or a uniform-TP job with Megatron's optimizer."""

import contextlib
import time

import torch
import torch.distributed as dist

from megatron_ext.testing import tiny_gpt

GLOBAL_BATCH = 4
LR = 1e-3
WEIGHT_DECAY = 0.01


def train(
    ntp_kwargs,
    steps,
    *,
    spec=tiny_gpt.TinyGPTSpec(),
    tp=1,
    distributed_optimizer=False,
    overlap=False,
    grad_reduce_in_fp32=True,
    global_batch=GLOBAL_BATCH,
    lr=LR,
    microbatches=1,
    bf16=False,
    symm_mem=None,
    collectives=False,
    sequence_parallel=False,
):
    """Train the tiny GPT for ``steps`` Megatron-optimizer steps.

    ``ntp_kwargs is None``: uniform TP=``tp`` with Megatron's own DDP. Else an
    NTP job from ``NonuniformTPConfig(**ntp_kwargs)``. Returns this rank's
    replica, TP rank, per-step losses and times (``microbatches`` > 1:
    gradient accumulation under ``no_sync``; ``symm_mem``: SymmMemConfig kwargs
    for symmetric-memory staging of the NTP buckets; ``sequence_parallel``: on every replica at
    TP > 1, as Megatron allows), and the full (TP=1) weights at
    init and after training (TP rank 0 of each replica only), or ``None`` on a
    rank that left (simulate mode). ``collectives``: also every collective this rank
    issued from the DDP's construction to the end of training (``CollectiveLog``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel, ddp_memory_report
    from megatron_ext.nonuniform_tp.checkpoint import gather_full_state, model_sharded_state_dict, shard_specs
    from megatron_ext.testing.ntp_job import init_job

    job = init_job(ntp_kwargs, tp)
    if job is None:
        return None
    ntp_cfg, replica, replicas, degraded = job.ntp_config, job.replica, job.replicas, job.degraded
    if ntp_cfg is not None:
        # what a Megatron data loader asks (spares included): its replica's share
        assert (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()) == (replica, replicas)
    tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    overrides = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
    cfg = tiny_gpt.transformer_config(
        spec, tp=tp_size, sequence_parallel=sequence_parallel and tp_size > 1, **overrides
    )
    dev = tiny_gpt.rank_device()
    model = tiny_gpt.build_model(spec, cfg, device=dev)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    init = gather_full_state(model, tp_group, spec.gated_linear_unit)
    log = None
    if collectives:
        from megatron_ext.testing.collectives import CollectiveLog

        log = CollectiveLog().__enter__()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=4096 if overlap else None,
    )
    if ntp_cfg is None:
        ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=model)
    else:
        symm_cfg = None
        if symm_mem is not None:
            from megatron_ext.fsdp_symm import SymmMemConfig

            symm_cfg = SymmMemConfig(**symm_mem)
        ddp = NonuniformTPDistributedDataParallel(cfg, ddp_config, model, ntp_config=ntp_cfg, symm_mem_config=symm_cfg)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            clip_grad=1.0,
            bf16=bf16,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp],
    )
    n_local = global_batch // replicas
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        tokens, labels = tiny_gpt.global_batch(spec, step=step, num_samples=global_batch)
        mine = slice(replica * n_local, (replica + 1) * n_local)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        tokens, labels = tokens[mine].to(dev), labels[mine].to(dev)
        loss = 0.0
        for micro in range(microbatches):
            part = slice(micro * n_local // microbatches, (micro + 1) * n_local // microbatches)
            context = ddp.no_sync() if micro < microbatches - 1 else contextlib.nullcontext()
            with context:
                micro_loss = tiny_gpt.forward_loss(ddp, tokens[part], labels[part]) / microbatches
                micro_loss.backward()
            loss = loss + micro_loss.detach()
        # With overlap, bucket groups whose grads are complete are already in flight (and a
        # degraded replica's gradients already with its partner).
        in_flight = sum(bg.grad_reduce_handle is not None for bg in ddp.bucket_groups)
        pair = getattr(ddp, "_pair", None)
        sent = None if pair is None or pair.partner else sum(pair.done)
        finalize_model_grads([ddp])
        ok, _, _ = opt.step()
        assert ok, f"optimizer step {step} was skipped"
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    ddp.zero_grad_buffer()  # degraded NTP replicas take their partner's last weights here
    if log is not None:
        log.__exit__(None, None, None)
    compute = getattr(ddp, "compute_module", ddp.module)
    final = gather_full_state(compute, tp_group, spec.gated_linear_unit)
    sharded = model_sharded_state_dict(ddp)
    refusal = None
    if getattr(ddp, "ntp_role", None) == "degraded":  # saving from a degraded replica alone is refused
        try:
            ddp.state_dict()
        except RuntimeError as err:
            refusal = str(err)
    dist.barrier(group=tp_group)
    keep = tp_rank == 0
    cpu = lambda m: {n: p.detach().cpu().clone() for n, p in m.named_parameters()}  # noqa: E731
    return dict(
        replica=replica,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_size_base=ntp_cfg.tp_base if ntp_cfg is not None else tp_size,
        degraded=degraded,
        sequence_parallel=cfg.sequence_parallel,
        bucket_groups=len(ddp.bucket_groups),
        in_flight_after_backward=in_flight,
        sent_after_backward=sent,
        transfer_groups=None if pair is None else len(pair.units),
        transfer_units=None if pair is None else sum(len(u) for u in pair.units),
        collectives=None if log is None else log.calls,
        symm_decisions=[d for _, d in getattr(ddp, "symm_mem_decisions", [])],
        losses=losses,
        times=times,
        init=init if keep else None,
        final=final if keep else None,
        train_state=cpu(ddp.module),
        compute_state=cpu(compute),
        role=getattr(ddp, "ntp_role", "uniform"),
        specs=shard_specs(compute, spec.gated_linear_unit),
        sharded=None if sharded is None else describe_sharded(sharded),
        state_dict_refusal=refusal,
        memory=ddp_memory_report(ddp, opt),
    )


def describe_sharded(sharded_state_dict):
    """``{key: [(key, global_shape, global_offset, axis_fragmentations, data), ...]}``: the
    ShardedTensors of a sharded state dict (factories built), without replica ids; data on CPU."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = {}
    for key, sh in sharded_state_dict.items():
        if isinstance(sh, ShardedObject):
            out[key] = [(sh.key, "object")]
            continue
        parts = sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]
        parts = list(parts.values()) if isinstance(parts, dict) else parts
        assert all(isinstance(t, ShardedTensor) for t in parts), (key, parts)
        out[key] = [
            (
                t.key,
                tuple(t.global_shape),
                tuple(t.global_offset),
                tuple(t.axis_fragmentations),
                t.data.detach().cpu().clone(),
            )
            for t in parts
        ]
    return out


def train_cases(cases):
    """Several :func:`train_with_schedule` runs in one spawned job (one start-up for
    all): ``cases`` is a list of ``(ntp_kwargs, steps, kwargs)``; the model-parallel
    state is torn down between them. Returns the list of results."""
    from megatron.core import parallel_state as ps

    from megatron_ext.nonuniform_tp import destroy_nonuniform_tp_process_groups

    results = []
    for ntp_kwargs, steps, kwargs in cases:
        results.append(train_with_schedule(ntp_kwargs, steps, **kwargs))
        dist.barrier()
        destroy_nonuniform_tp_process_groups()
        ps.destroy_model_parallel()
    return results


class StepClock:
    """A fake clock for ``MeasuredBalance``: called twice per timed step (``step_started``,
    then the ``finalize_model_grads`` wrapper), it makes step ``k`` last ``seconds[k]``
    exactly (it reads 0 at the start of every step)."""

    def __init__(self, seconds):
        self.seconds, self.calls = list(seconds), 0

    def __call__(self):
        step, end = divmod(self.calls, 2)
        self.calls += 1
        return self.seconds[step] if end else 0.0


def loss_mask(spec, step, num_samples):
    """A per-token loss mask with a different number of tokens per sample:
    sample ``j`` of step ``step`` masks its first ``(3 * j + step) % 11`` tokens."""
    mask = torch.ones(num_samples, spec.seq_length)
    for j in range(num_samples):
        mask[j, : (3 * j + step) % 11] = 0
    return mask


def train_with_schedule(
    ntp_kwargs,
    steps,
    *,
    spec=tiny_gpt.TinyGPTSpec(),
    global_batch=GLOBAL_BATCH,
    micro_batch_size=1,
    distributed_optimizer=False,
    overlap=False,
    per_token_loss=False,
    measured=None,
    sequence_parallel=False,
    tp=1,
    pp=1,
    overlap_param_gather=False,
):
    """Train the tiny GPT as a Megatron training loop does: each replica gets its
    micro-batches of every global batch from ``BalancedPretrainingSampler`` and runs
    Megatron's forward-backward function with ``shares.num_microbatches()``.

    ``measured`` (with ``balance="measured"``): ``dict(steps=N, seconds={(replica, tp_rank):
    [compute seconds of warm-up step 0, 1, ...]})``: a ``MeasuredBalance`` timed by a fake
    clock that makes each warm-up step of this rank last the given seconds between
    ``step_started`` and the ``finalize_model_grads`` wrapper; when it returns new shares
    the DDP and the sampler switch to them (``sampler.switch`` at the consumed samples).

    ``ntp_kwargs is None``: uniform TP=``tp`` with Megatron's DDP and equal shares, else
    ``NonuniformTPConfig(**ntp_kwargs)`` (packed) with ``ntp_config.batch_shares``.
    The loss function reports ``(loss sum, token count)`` per micro-batch;
    ``per_token_loss``: ``calculate_per_token_loss`` with :func:`loss_mask`, else
    every token counts. ``sequence_parallel``: on every replica at TP > 1 (Megatron refuses it at
    TP 1). ``pp``: pipeline stages of the uniform job (an NTP job has its config's); Megatron's
    1F1B schedule, every stage reading the same micro-batches, the losses from the last stage.
    ``overlap_param_gather`` (with the distributed optimizer): the parameters gathered during the next
    forward. Returns this rank's replica, stage, its micro-batch count, the
    sample indices and ``(sum, count)`` of every micro-batch per step, the
    replica-weighted mean loss per step from ``reduce_loss_over_replicas``, and the
    full weights at init and after training (TP rank 0 only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.nonuniform_tp import (
        BalancedPretrainingSampler,
        NonuniformTPDistributedDataParallel,
        equal_batch_shares,
        ddp_memory_report,
        finalize_model_grads,  # Megatron's, with a satellite's token count joining its partner's
        reduce_loss_over_replicas,
    )
    from megatron_ext.nonuniform_tp.checkpoint import gather_full_state
    from megatron_ext.testing.ntp_job import init_job

    job = init_job(ntp_kwargs, tp, pp)
    ntp_cfg = job.ntp_config
    tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    pp = ps.get_pipeline_model_parallel_world_size()
    stage, last_stage = ps.get_pipeline_model_parallel_rank(), ps.is_pipeline_last_stage()
    balance = clock = None
    if ntp_cfg is None:
        shares = equal_batch_shares(job.replicas, global_batch, micro_batch_size)
    elif measured is not None:
        from megatron_ext.nonuniform_tp import MeasuredBalance

        clock = StepClock(measured["seconds"][job.replica, tp_rank])
        balance = MeasuredBalance(ntp_cfg, global_batch, micro_batch_size, measure_steps=measured["steps"], clock=clock)
        shares = balance.shares
    else:
        shares = ntp_cfg.batch_shares(global_batch, micro_batch_size)
    tp_size = ps.get_tensor_model_parallel_world_size()
    cfg = tiny_gpt.transformer_config(
        spec,
        tp=tp_size,
        pp=pp,
        calculate_per_token_loss=per_token_loss,
        sequence_parallel=sequence_parallel and tp_size > 1,
    )
    dev = tiny_gpt.rank_device()
    model = tiny_gpt.build_model(spec, cfg, device=dev)
    init = gather_full_state(model, tp_group, spec.gated_linear_unit)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
        bucket_size=4096 if overlap or overlap_param_gather else None,
    )
    if ntp_cfg is None:
        ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=model)
    else:
        ddp = NonuniformTPDistributedDataParallel(cfg, ddp_config, model, ntp_config=ntp_cfg, batch_shares=shares)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp],
    )
    cfg.no_sync_func = ddp.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads if balance is None else balance.timed(finalize_model_grads)
    forward_backward = get_forward_backward_func()
    batch_sampler = BalancedPretrainingSampler(steps * global_batch, 0, shares)
    sampler = iter(batch_sampler)
    seq = spec.seq_length
    position_ids = torch.arange(seq, device=dev).unsqueeze(0)
    attention_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=dev), diagonal=1)

    def forward_step(data_iterator, model):
        tokens, labels, mask = next(data_iterator)
        per_token = model(tokens, position_ids.expand_as(tokens), attention_mask, labels=labels)

        def loss_func(output):
            total = (output.float() * mask).sum()
            count = mask.sum().to(torch.int)
            return total, count, (total.detach().clone(), count.clone())

        return per_token, loss_func

    indices, reports, weighted, step_shares = [], [], [], []
    for step in range(steps):
        tokens, labels = tiny_gpt.global_batch(spec, step=step, num_samples=global_batch)
        mask = loss_mask(spec, step, global_batch) if per_token_loss else torch.ones(global_batch, seq)
        mine = [next(sampler) for _ in range(shares.num_microbatches())]
        rows = [[i - step * global_batch for i in micro] for micro in mine]
        assert all(0 <= r < global_batch for micro in rows for r in micro), (step, mine)
        data = iter([(tokens[r].to(dev), labels[r].to(dev), mask[r].to(dev)) for r in rows])
        ddp.zero_grad_buffer()
        opt.zero_grad()
        if balance is not None:
            balance.step_started()
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=shares.num_microbatches(),
            seq_length=seq,
            micro_batch_size=shares.micro_batch_size,
        )
        ok, _, _ = opt.step()
        assert ok, f"optimizer step {step} was skipped"
        indices.append(mine)
        reports.append([(s.item(), int(c)) for s, c in out])  # the last stage's (the others have none)
        local_mean = torch.stack([s / c for s, c in out]).mean().to(dev) if last_stage else torch.zeros((), device=dev)
        weighted.append(reduce_loss_over_replicas(local_mean, shares).item())
        step_shares.append(shares)
        new = balance.step_finished() if balance is not None else None
        if new is not None:  # between global batches: the DDP's weights and the sampler switch together
            shares = new
            ddp.set_batch_shares(shares)
            batch_sampler = batch_sampler.switch(shares, (step + 1) * global_batch)
            sampler = iter(batch_sampler)
    assert next(sampler, None) is None, "the sampler has samples beyond the last global batch"
    if overlap_param_gather:
        ddp.disable_forward_pre_hook()  # as Megatron-LM ends training: the last step's parameters gathered
    ddp.zero_grad_buffer()  # degraded NTP replicas take their partner's last weights here (no overlap_param_gather)
    if hasattr(ddp, "refresh_compute_params"):
        ddp.refresh_compute_params()  # (with it, here: the partner's gathered parameters)
    compute = getattr(ddp, "compute_module", ddp.module)
    final = gather_full_state(compute, tp_group, spec.gated_linear_unit)
    keep = tp_rank == 0
    return dict(
        role=getattr(ddp, "ntp_role", "uniform"),
        memory=ddp_memory_report(ddp, opt),
        compute_state={n: p.detach().cpu().clone() for n, p in compute.named_parameters()},
        replica=job.replica,
        tp_rank=tp_rank,
        stage=stage,
        last_stage=last_stage,
        degraded=job.degraded,
        sequence_parallel=cfg.sequence_parallel,
        sp_params=sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)),
        microbatches=list(step_shares[0].microbatches),
        step_shares=step_shares,
        measured_seconds=None if balance is None else balance.seconds,
        clock_calls=None if clock is None else clock.calls,
        indices=indices,
        reports=reports,
        weighted=weighted,
        init=init if keep else None,
        final=final if keep else None,
    )


def per_token_loss_without_the_wrapper(ntp_kwargs):
    """One step with ``calculate_per_token_loss`` through Megatron's own ``finalize_model_grads``
    (not ``megatron_ext.nonuniform_tp.finalize_model_grads``): returns what this rank's sync raised."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel
    from megatron_ext.testing.ntp_job import init_job

    job = init_job(ntp_kwargs)
    spec = tiny_gpt.TinyGPTSpec()
    cfg = tiny_gpt.transformer_config(spec, tp=ps.get_tensor_model_parallel_world_size(), calculate_per_token_loss=True)
    model = tiny_gpt.build_model(spec, cfg)
    ddp = NonuniformTPDistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, ntp_config=job.ntp_config
    )
    tokens, labels = tiny_gpt.global_batch(spec, step=0, num_samples=2)
    tiny_gpt.forward_loss(ddp, tokens[job.replica : job.replica + 1], labels[job.replica : job.replica + 1]).backward()
    try:
        finalize_model_grads([ddp], torch.tensor(16))
    except RuntimeError as err:
        return ddp.ntp_role, str(err)
    return ddp.ntp_role, None
