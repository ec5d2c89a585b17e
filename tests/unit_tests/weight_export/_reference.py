"""Test-only reference: Megatron GPT state (TP=1; MoE experts under global
indices) -> HF names, written out by hand independently of
megatron_ext.weight_export's mapping code."""

import torch

# gpt_specs(**SPECS): a small dense GQA model with a padded vocabulary (config and reshard-check tests).
SPECS = dict(
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_groups=2,
    head_dim=8,
    ffn_hidden_size=48,
    vocab_size=100,
    padded_vocab_size=128,
    dtype=torch.float32,
)


def hf_state_from_megatron(state: dict, *, num_layers, num_heads, num_groups, hidden, vocab, tied) -> dict:
    hd = hidden // num_heads
    hpg = num_heads // num_groups
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    if not tied:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    for i in range(num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        for suffix in ("weight", "bias"):
            key = m + "self_attention.linear_qkv." + suffix
            if key not in state:
                continue
            w = state[key]
            groups = [w[g * (hpg + 2) * hd : (g + 1) * (hpg + 2) * hd] for g in range(num_groups)]
            out[h + "self_attn.q_proj." + suffix] = torch.cat([g[: hpg * hd] for g in groups])
            out[h + "self_attn.k_proj." + suffix] = torch.cat([g[hpg * hd : (hpg + 1) * hd] for g in groups])
            out[h + "self_attn.v_proj." + suffix] = torch.cat([g[(hpg + 1) * hd :] for g in groups])
        for mq, hq in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if m + f"self_attention.{mq}.weight" in state:
                out[h + f"self_attn.{hq}.weight"] = state[m + f"self_attention.{mq}.weight"]
        out[h + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        if m + "mlp.router.weight" in state:  # MoE layer; experts under their global index
            out[h + "mlp.gate.weight"] = state[m + "mlp.router.weight"]
            e = 0
            while f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight" in state:
                fc1 = state[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"]
                half = fc1.shape[0] // 2
                out[h + f"mlp.experts.{e}.gate_proj.weight"] = fc1[:half]
                out[h + f"mlp.experts.{e}.up_proj.weight"] = fc1[half:]
                out[h + f"mlp.experts.{e}.down_proj.weight"] = state[
                    f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"
                ]
                e += 1
            continue
        fc1 = state[m + "mlp.linear_fc1.weight"]
        out[h + "mlp.gate_proj.weight"] = fc1[: fc1.shape[0] // 2]
        out[h + "mlp.up_proj.weight"] = fc1[fc1.shape[0] // 2 :]
        out[h + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
    return {k: v.detach().clone() for k, v in out.items()}


def hf_checkpoint_names(params: dict) -> dict:
    """An HF model's tensors (``{name: tensor}``) under checkpoint names: fused 3-D
    experts (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)) split per expert by hand."""
    out = {}
    for name, p in params.items():
        p = p.detach().clone()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = p[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = p[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = p[e]
        else:
            out[name] = p
    return out


def reference_for(spec, model) -> dict:
    state = {n: p for n, p in model.named_parameters()}
    return hf_state_from_megatron(
        state,
        num_layers=spec.num_layers,
        num_heads=spec.num_attention_heads,
        num_groups=spec.num_query_groups,
        hidden=spec.hidden_size,
        vocab=spec.hf_vocab_size,
        tied=spec.tie_embeddings,
    )


def gather_tp(name: str, param, group=None) -> torch.Tensor:
    """``param``'s full tensor over the TP group (or ``group``, e.g. the expert-TP
    group), with one plain ``all_gather`` (independent of the exporter); GLU
    ``linear_fc1`` shards are ``[gate_r; up_r]``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    t = param.detach()
    group = ps.get_tensor_model_parallel_group() if group is None else group
    tp = dist.get_world_size(group)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if name.endswith("linear_fc1.weight"):
        return torch.cat([x.chunk(2)[0] for x in parts] + [x.chunk(2)[1] for x in parts], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


def moe_full_state(model) -> dict:
    """A MoE GPTModel's whole Megatron tensors (CPU) under global names, on every rank, gathered
    independently of the exporter: one plain ``all_gather`` per parameter over its TP or expert-TP
    group, the EP ranks' experts with one ``all_gather_object`` each (experts under their global
    index), then the pipeline stages'. TE grouped-expert names (``as_te_grouped_moe``) are read
    back as the local spec's (a dense layer's fused pre-MLP norm too). Collective over every rank."""
    import re

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    num_local = model.config.num_moe_experts // ep
    state = {}
    for name, p in model.named_parameters():
        name = re.sub(r"\.experts\.(linear_fc[12])\.weight(\d+)$", r".experts.local_experts.\2.\1.weight", name)
        name = name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
        name = name.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")  # TE: a dense layer
        if name.startswith("decoder.layers."):  # global layer numbers (pipeline stages)
            j, rest = name[len("decoder.layers.") :].split(".", 1)
            name = f"decoder.layers.{model.decoder.layers[int(j)].layer_number - 1}.{rest}"
        if ".local_experts." in name:  # expert-TP shards (plain all_gather), then EP ranks' experts
            t = gather_tp(name, p, group=ps.get_expert_tensor_parallel_group())
            copies = [None] * ep
            dist.all_gather_object(copies, t.cpu().clone(), group=ps.get_expert_model_parallel_group())
            head, tail = name.split(".local_experts.")
            local, suffix = tail.split(".", 1)
            for r, c in enumerate(copies):
                state[f"{head}.local_experts.{r * num_local + int(local)}.{suffix}"] = c
            continue
        state[name] = gather_tp(name, p).cpu().clone()
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, state, group=ps.get_pipeline_model_parallel_group())
    return {k: v for s in stages for k, v in s.items()}


def gathered_hf_state(spec, model) -> dict:
    """The full HF tensors (CPU) of a TP x PP Megatron model of ``spec``, on every rank,
    gathered by hand, independently of the export hook and the reshard executor: one
    plain ``all_gather`` per parameter over its TP group (:func:`gather_tp`), stage-local
    layer names made global from Megatron's own ``layer_number``, the stages' states
    combined with one ``all_gather_object`` over the PP group, then
    :func:`hf_state_from_megatron`. Collective over the TP and PP groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    state = {}
    for name, p in model.named_parameters():
        t = gather_tp(name, p)
        if name.startswith("decoder.layers."):
            j, rest = name[len("decoder.layers.") :].split(".", 1)
            name = f"decoder.layers.{model.decoder.layers[int(j)].layer_number - 1}.{rest}"
        state[name] = t.detach().to("cpu", copy=True)
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, state, group=ps.get_pipeline_model_parallel_group())
    full = {k: v for stage in stages for k, v in stage.items()}
    return hf_state_from_megatron(
        full,
        num_layers=spec.num_layers,
        num_heads=spec.num_attention_heads,
        num_groups=spec.num_query_groups,
        hidden=spec.hidden_size,
        vocab=spec.hf_vocab_size,
        tied=spec.tie_embeddings,
    )


def snapshot(tensors: dict) -> dict:
    """CPU copies of ``tensors``, taken now. Always a copy: ``Tensor.cpu()`` copies a CUDA
    tensor but returns a CPU tensor itself, so a snapshot taken too early (before the
    refit that writes the tensors) would still see the later writes on gloo and pass
    there, yet fail on NCCL."""
    return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}


def hook_reference(model, vocab_size: int):
    """``(exporter, got)``: the export hook into a dict in this process. Each
    ``exporter.export()`` fills ``got`` (on the export rank) with CPU copies of the
    full HF tensors: the reference the reshard tests compare engine tensors to."""
    from megatron_ext import weight_export as wx

    got = {}
    consumer = wx.LoadWeightsConsumer(lambda ws: got.update({n: t.cpu().clone() for n, t in ws}))
    exporter = wx.WeightExporter(model, wx.RefitConfig(vocab_size=vocab_size), receiver=wx.WeightReceiver(consumer))
    return exporter, got


def tp_job(spec, backend: str, tp: int):
    """One rank of a Megatron TP ``tp`` job (parallel state initialised): ``(rank, device,
    config, model)``, the tiny Llama ``spec`` on this rank's GPU (NCCL) or the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.testing import tiny_llama

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    cfg = tiny_llama.transformer_config(spec, tp=tp)
    return dist.get_rank(), device, cfg, tiny_llama.build_model(spec, cfg, device=device)


def pipelined_ntp_job(spec, ntp: dict, steps: int):
    """One rank of a pipelined nonuniform-TP job of the tiny Llama ``spec`` (``NonuniformTPConfig(**ntp)``),
    trained ``steps`` Adam steps through Megatron's 1F1B schedule (CPU, gloo): ``(job, model, ddp)``. Right after
    the last step a degraded replica's weights are stale until its partner sends them."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel
    from megatron_ext.testing import tiny_llama
    from megatron_ext.testing.ntp_job import init_job, train_pipelined

    job = init_job(ntp)
    pp = job.ntp_config.pipeline_model_parallel_size
    cfg = tiny_llama.transformer_config(
        spec, tp=ps.get_tensor_model_parallel_world_size(), pp=pp, pipeline_dtype=torch.float32
    )
    model = tiny_llama.build_model(spec, cfg)
    ddp = NonuniformTPDistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, ntp_config=job.ntp_config
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [ddp])
    train_pipelined(ddp, opt, spec, steps, job)
    return job, model, ddp


def megatron_shard(kind: str, tensors: list, tp: int, rank: int, *, dim=0, num_groups=0, padded_rows=None):
    """TP shard ``rank`` of ``tp`` of one Megatron parameter, from its whole HF tensors:
    ``linear_qkv`` is ``[q heads of g; k_g; v_g]`` for each of the rank's query groups
    ``g``, ``linear_fc1`` is ``[gate_r; up_r]``, a vocabulary tensor is padded to
    ``padded_rows`` before it is split, ``dim=None`` is replicated."""
    if kind == "qkv":
        q, k, v = tensors
        kv, qg = k.shape[0] // num_groups, q.shape[0] // num_groups
        groups = range(rank * num_groups // tp, (rank + 1) * num_groups // tp)
        return torch.cat(
            [torch.cat([q[g * qg : (g + 1) * qg], k[g * kv : (g + 1) * kv], v[g * kv : (g + 1) * kv]]) for g in groups]
        )
    if kind == "glu":
        gate, up = tensors
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    (w,) = tensors
    if dim is None or tp == 1:
        return w
    if padded_rows:
        w = torch.cat([w, w.new_zeros(padded_rows - w.shape[0], *w.shape[1:])])
    return w.chunk(tp, dim)[rank].contiguous()
