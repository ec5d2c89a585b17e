"""MoE (Qwen3-MoE style) export: a real megatron-core MoE GPTModel on CPU,
single rank and expert-parallel (EP2; TP2 x EP2; PP2 x EP2), streams into a
real ``transformers`` Qwen3MoeForCausalLM (fused 3-D experts) under per-expert
checkpoint names. The receiver's tensors equal a hand-written conversion of
the trainer's own parameters (gathered with plain per-parameter collectives),
logits and greedy generation match, each bucket costs one collective in its
group, and unsupported MoE variants are refused by name."""

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks
from megatron_ext.testing.receiver_proc import start_hf_receiver

from ._reference import hf_checkpoint_names, hf_state_from_megatron, moe_full_state

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen3_moe")
TIMEOUT = 240
BUCKET_MB = 0.1  # several dense and several expert buckets, each with several weights
# Dense MLP and MoE layers mixed (Megatron's moe_layer_freq; Qwen3-MoE's mlp_only_layers): a list with dense first
# and last layers, and an int k (every k-th layer from layer 0 an MoE layer). Dense MLPs are ffn_hidden_size=96
# wide, experts 32: a dense layer mapped as MoE (or the reverse) cannot go unnoticed.
MIXED = dataclasses.replace(SPEC, num_layers=4)
MIXED_FREQS = {"list": ([0, 1, 1, 0], [0, 3]), "int": (2, [1, 3])}  # moe_layer_freq -> HF mlp_only_layers


def _reference(state):
    return hf_state_from_megatron(
        state,
        num_layers=SPEC.num_layers,
        num_heads=SPEC.num_attention_heads,
        num_groups=SPEC.num_query_groups,
        hidden=SPEC.hidden_size,
        vocab=SPEC.hf_vocab_size,
        tied=SPEC.tie_embeddings,
    )


def _layout_names(cfg):
    from megatron_ext.sharding import specs_from_config

    return {s.name for s in specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)}


def _mixed_single_rank(freq):
    """The tiny Qwen3-MoE with 4 layers, dense and MoE by ``moe_layer_freq=freq``, on one rank: the export hook
    into a Qwen3MoeForCausalLM built with the same pattern (``hf_config_from_megatron``: ``mlp_only_layers``),
    and a reshard refit (ReshardExecutor, trainer layout -> engine TP1 layout: fused qkv / gate_up) whose whole HF
    tensors pass the HF model's tensor check (``EngineRefit``'s: names, shapes, dtypes) and load into another one;
    then the same model under TE's names (dense layers: the pre-MLP norm fused into ``linear_fc1``)."""
    from megatron_ext import weight_export as wx
    from megatron_ext.sharding import megatron_layout, specs_from_model
    from megatron_ext.weight_export.exec.reshard import ReshardExecutor
    from megatron_ext.weight_export.plan.layout import inference_layout
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    cfg = tiny_llama.transformer_config(MIXED, moe_layer_freq=freq)
    model = tiny_llama.build_model(MIXED, cfg)
    toks = tiny_llama.tokens(MIXED)
    hf = tiny_llama.hf_model(MIXED, cfg)
    before = wx.verify_export(wx.megatron_logits(model, toks), wx.HFModelConsumer(hf).logits(toks))
    exporter = wx.WeightExporter(
        model,
        wx.RefitConfig(vocab_size=MIXED.hf_vocab_size, bucket_size_mb=0.02),
        receiver=wx.WeightReceiver(wx.HFModelConsumer(hf)),
    )
    exporter.export()
    out = dict(
        mlp_only_layers=list(hf.config.mlp_only_layers),
        hf_dense=sorted(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate_proj")),
        megatron_dense=sorted(i for i, layer in enumerate(model.decoder.layers) if not hasattr(layer.mlp, "router")),
        before=before,
        after=exporter.verify(toks),
        plan_names={t.name for t in exporter.plan.tensors()},
        layout_names=_layout_names(cfg),
        received=hf_checkpoint_names(dict(hf.named_parameters())),
        reference=hf_state_from_megatron(
            dict(model.named_parameters()),
            num_layers=MIXED.num_layers,
            num_heads=MIXED.num_attention_heads,
            num_groups=MIXED.num_query_groups,
            hidden=MIXED.hidden_size,
            vocab=MIXED.hf_vocab_size,
            tied=MIXED.tie_embeddings,
        ),
    )
    specs = specs_from_model(model, vocab_size=MIXED.hf_vocab_size)
    src, dst = megatron_layout(specs, tp=1), inference_layout(specs, tp=1)
    engine = {n: torch.full(lt.shape, float("nan")) for n, lt in dst.tensors[0].items()}
    tensors = {**wx.megatron_tensors(model), **engine}
    out["refit_stats"] = ReshardExecutor(build_reshard_plan(src, dst), 0, tensors, bucket_bytes=4096).refit(1)
    consumer = wx.HFModelConsumer(tiny_llama.hf_model(MIXED, cfg))
    whole = dict(dst.hf_tensors(0, engine))
    expected = consumer.expected_tensors()
    out["refit_check"] = sorted(set(expected) ^ set(whole)) + [
        n for n, t in whole.items() if n in expected and expected[n] != (tuple(t.shape), t.dtype)
    ]
    out["engine_names"] = sorted(engine)
    consumer.load_weights(whole.items())
    out["refit_gate"] = wx.verify_export(wx.megatron_logits(model, toks), consumer.logits(toks))
    tiny_llama.as_te_grouped_moe(model)
    te_hf = tiny_llama.hf_model(MIXED, cfg)
    wx.WeightExporter(
        model,
        wx.RefitConfig(vocab_size=MIXED.hf_vocab_size, bucket_size_mb=0.02),
        receiver=wx.WeightReceiver(wx.HFModelConsumer(te_hf)),
    ).export()
    out["te_names"] = sorted(n for n, _ in model.named_parameters())
    out["te_received"] = hf_checkpoint_names(dict(te_hf.named_parameters()))
    return out


EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _plan_summary(plan):
    """Who sends what, read from the plan's transfers: an expert's source ranks as
    (EP rank, expert-TP rank) (the export layout's rank ``j`` of a stage is
    ``divmod(j, etp)`` for the experts' gatherers), and the dim its slices split."""
    from megatron_ext.weight_export.plan.export_plan import stage_ranks

    per_stage = stage_ranks(plan.tp_size, plan.ep_size, plan.etp_size)
    holders = {}
    for b in plan.buckets:
        for t in b.transfers:
            m = EXPERT.fullmatch(t.name)
            if m:
                layer, e, part = int(m.group(1)), int(m.group(2)), m.group(3)
                fc = "linear_fc2" if part == "down" else "linear_fc1"
                holders.setdefault((layer, e, fc), []).append((divmod(t.src % per_stage, plan.etp_size), t.box))
    split = {
        k: next((d for d in range(2) if len({box.ranges[d] for _, box in v}) > 1), None) for k, v in holders.items()
    }
    return dict(
        groups=[(b.pp_rank, b.group, len(b.tensors)) for b in plan.buckets],
        owners={e: v[0][0][0] for (_, e, _), v in holders.items()},
        holders={k: (tuple(sorted({c for c, _ in v})), split[k]) for k, v in holders.items()},
        etp_size=plan.etp_size,
        names={t.name for t in plan.tensors()},
    )


# ----------------------------------------------------------------- single rank
def _single_rank():
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.weight_export.transports.ipc_direct import direct_copies, direct_entries

    ps.initialize_model_parallel()
    cfg = tiny_llama.transformer_config(SPEC)
    model = tiny_llama.build_model(SPEC, cfg)
    hf = tiny_llama.hf_model(SPEC, cfg)
    toks = tiny_llama.tokens(SPEC)
    before = wx.verify_export(wx.megatron_logits(model, toks), wx.HFModelConsumer(hf).logits(toks))
    receiver = wx.WeightReceiver(wx.HFModelConsumer(hf))
    exporter = wx.WeightExporter(
        model, wx.RefitConfig(vocab_size=SPEC.hf_vocab_size, bucket_size_mb=0.02), receiver=receiver
    )
    result = exporter.export()
    after = exporter.verify(toks)
    prompt = toks[:, :6]
    hf.generation_config.eos_token_id = None  # always 5 new tokens
    with torch.no_grad():
        generated = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    ref_logits = wx.megatron_logits(model, generated)[:, 5:-1, : SPEC.hf_vocab_size]
    chosen = ref_logits.gather(-1, generated[:, 6:, None]).squeeze(-1)
    out = dict(
        before=before,
        after=after,
        result=result,
        plan=_plan_summary(exporter.plan),
        layout_names=_layout_names(cfg),
        generated=generated,
        greedy_gap=(ref_logits.max(-1).values - chosen).max().item(),
        received=hf_checkpoint_names(dict(hf.named_parameters())),
        reference=_reference(dict(model.named_parameters())),
    )

    # ipc-direct's view descriptions, applied without IPC into the fused experts and to load_weights.
    transfers = [t for b in exporter.plan.buckets for t in b.transfers]
    bases, entries = direct_entries(transfers, wx.megatron_tensors(model))
    direct_hf, loaded = tiny_llama.hf_model(SPEC, cfg), {}
    for consumer in (
        wx.HFModelConsumer(direct_hf),
        wx.LoadWeightsConsumer(lambda ws: loaded.update({n: t.clone() for n, t in ws})),
    ):
        r = wx.WeightReceiver(consumer)
        r.set_plan(exporter.plan)
        r.begin(1)
        r.load_direct(*direct_copies(bases, entries, consumer))
        r.finish(1)
    out["direct"] = {"target": hf_checkpoint_names(dict(direct_hf.named_parameters())), "load_weights": loaded}

    # A receiver with other expert shapes is refused, naming the per-expert tensor, before any write.
    small = dataclasses.replace(SPEC, moe_ffn_hidden_size=16)
    wrong = tiny_llama.hf_model(small, tiny_llama.transformer_config(small))
    snapshot = {n: p.detach().clone() for n, p in wrong.named_parameters()}
    try:
        wx.WeightExporter(
            model,
            wx.RefitConfig(vocab_size=SPEC.hf_vocab_size),
            receiver=wx.WeightReceiver(wx.HFModelConsumer(wrong)),
        ).export()
        out["refused"] = ("no error", False)
    except wx.PlanMismatch as exc:
        out["refused"] = (str(exc), all(torch.equal(p, snapshot[n]) for n, p in wrong.named_parameters()))

    # Unsupported variants of real Megatron MoE models: the error names the parameter.
    out["unsupported"] = {}
    for what, overrides in (
        ("shared_experts", dict(moe_shared_expert_intermediate_size=32)),
        ("sigmoid_router", dict(moe_router_score_function="sigmoid")),
    ):
        variant = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC, **overrides))
        try:
            wx.specs_from_model(variant, vocab_size=SPEC.hf_vocab_size)
            out["unsupported"][what] = "no error"
        except wx.UnsupportedParameter as exc:
            out["unsupported"][what] = str(exc)

    # The same model under Transformer Engine's names (TEGroupedMLP experts, fused input layernorm):
    # exported into a fresh HF model, it must give exactly the SequentialMLP export's tensors.
    from megatron_ext.sharding import specs_from_model

    sequential_logits = wx.megatron_logits(model, toks)
    tiny_llama.as_te_grouped_moe(model)
    grouped_hf = tiny_llama.hf_model(SPEC, cfg)
    grouped = wx.WeightExporter(
        model,
        wx.RefitConfig(vocab_size=SPEC.hf_vocab_size, bucket_size_mb=0.02),
        receiver=wx.WeightReceiver(wx.HFModelConsumer(grouped_hf)),
    )
    grouped.export()
    specs = specs_from_model(model, vocab_size=SPEC.hf_vocab_size)
    out["grouped"] = dict(
        names=sorted(n for n, _ in model.named_parameters()),
        result=grouped.last_result,
        verify=grouped.verify(toks),
        same_logits=torch.equal(wx.megatron_logits(model, toks), sequential_logits),
        received=hf_checkpoint_names(dict(grouped_hf.named_parameters())),
        plan=_plan_summary(grouped.plan),
        expert_order=[[t.name for t in b.tensors] for b in grouped.plan.buckets if b.group == "ep"],
        sequential_order=[[t.name for t in b.tensors] for b in exporter.plan.buckets if b.group == "ep"],
        owners=[t.src_run.local for b in grouped.plan.buckets for t in b.transfers],
        layout_names={s.name for s in specs},
        layout_experts={s.megatron_name for s in specs if s.expert is not None},
    )

    out["mixed"] = {key: _mixed_single_rank(freq) for key, (freq, _) in MIXED_FREQS.items()}
    # a model whose layers are not its config's pattern (built as if every layer were an MoE layer): named
    unbuilt = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC))  # every layer an MoE layer
    unbuilt.config.moe_layer_freq = [0, 1]  # its config: a dense first layer
    try:
        wx.specs_from_model(unbuilt, vocab_size=SPEC.hf_vocab_size)
        out["mixed"]["not built"] = "no error"
    except wx.UnsupportedParameter as exc:
        out["mixed"]["not built"] = str(exc)
    return out


@pytest.fixture(scope="module")
def single():
    (out,) = run_on_ranks(_single_rank, 1, timeout=TIMEOUT)
    return out


def test_single_rank_hf_state_equals_hand_converted_megatron_weights(single):
    assert single["received"].keys() == single["reference"].keys()
    for name, ref in single["reference"].items():
        assert torch.equal(single["received"][name], ref), name
    # Per-expert names, exactly the reshard layout's names.
    assert single["plan"]["names"] == single["layout_names"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in single["plan"]["names"]


def test_single_rank_logits_and_greedy_generation_match(single):
    assert single["before"].max_abs_diff > 0.1, "HF model matched before export: the check is vacuous"
    assert single["after"].max_abs_diff < 1e-4 and abs(single["after"].kl) < 1e-6, single["after"]
    assert single["result"].applied == (1,)
    assert single["generated"].shape == (2, 11)
    assert single["greedy_gap"] < 1e-4, single["greedy_gap"]


def test_single_rank_plan_separates_dense_and_expert_buckets(single):
    groups = single["plan"]["groups"]
    assert {g for _, g, _ in groups} == {"tp", "ep"}
    assert len([g for _, g, _ in groups if g == "ep"]) > 1
    assert single["plan"]["owners"] == {e: 0 for e in range(SPEC.num_moe_experts)}


@pytest.mark.parametrize("path", ["target", "load_weights"])
def test_direct_ipc_views_fill_fused_experts(single, path):
    got = single["direct"][path]
    assert got.keys() == single["reference"].keys()
    for name, ref in single["reference"].items():
        assert torch.equal(got[name], ref), name


def test_wrong_expert_shape_refused_by_name_before_any_write(single):
    message, unchanged = single["refused"]
    assert (
        "'model.layers.0.mlp.experts.0.gate_proj.weight' has shape (32, 64), the receiver's has (16, 64)" in message
    ), message
    assert unchanged


def test_unsupported_real_moe_variants_are_named(single):
    shared, sigmoid = single["unsupported"]["shared_experts"], single["unsupported"]["sigmoid_router"]
    assert "'decoder.layers.0.mlp.shared_experts.linear_fc1.weight'" in shared, shared
    assert "moe_shared_expert_intermediate_size" in shared
    assert "decoder.layers.0.mlp.router.weight" in sigmoid and "moe_router_score_function='softmax'" in sigmoid


@pytest.mark.parametrize("freq", MIXED_FREQS)
def test_mixed_dense_and_moe_layers_export_and_refit_to_qwen3_moe_mlp_only_layers(single, freq):
    """moe_layer_freq (a list, an int): the dense layers are Qwen3-MoE's mlp_only_layers, exported under the
    dense MLP's names (``mlp.gate_proj``), the MoE layers under the experts'; the HF tensors equal a hand
    conversion, the logits match; a reshard refit's engine tensors load into the same HF model and match too;
    TE's names (a dense layer's pre-MLP norm fused into ``linear_fc1``) export the same tensors."""
    got = single["mixed"][freq]
    dense = MIXED_FREQS[freq][1]
    # the pattern as megatron-core builds it, and the HF model with the same one
    assert got["megatron_dense"] == got["hf_dense"] == got["mlp_only_layers"] == dense, got["mlp_only_layers"]
    assert got["received"].keys() == got["reference"].keys()
    for name, ref in got["reference"].items():
        assert torch.equal(got["received"][name], ref), name
    assert got["plan_names"] == got["layout_names"] == got["reference"].keys()
    for i in range(MIXED.num_layers):
        mlp = f"model.layers.{i}.mlp."
        assert (mlp + "gate_proj.weight" in got["plan_names"]) == (i in dense), i
        assert (mlp + "experts.3.down_proj.weight" in got["plan_names"]) == (i not in dense), i
        assert (mlp + "gate.weight" in got["plan_names"]) == (i not in dense), i
    assert got["before"].max_abs_diff > 0.1, "HF model matched before export: the check is vacuous"
    assert got["after"].max_abs_diff < 1e-4 and abs(got["after"].kl) < 1e-6, got["after"]
    # the reshard refit: the engine's fused tensors of a dense layer, whole HF tensors the HF model holds as sent
    assert f"model.layers.{dense[0]}.mlp.gate_up_proj.weight" in got["engine_names"]
    assert got["refit_check"] == [], got["refit_check"]
    assert got["refit_stats"].local_bytes > 0
    assert got["refit_gate"].max_abs_diff < 1e-4 and abs(got["refit_gate"].kl) < 1e-6, got["refit_gate"]
    # TE layer spec names of the same model: dense layers' fused pre-MLP norm, MoE layers' separate one
    te = got["te_names"]
    assert f"decoder.layers.{dense[0]}.mlp.linear_fc1.layer_norm_weight" in te
    assert f"decoder.layers.{dense[0]}.pre_mlp_layernorm.weight" not in te
    moe = next(i for i in range(MIXED.num_layers) if i not in dense)
    assert f"decoder.layers.{moe}.pre_mlp_layernorm.weight" in te
    assert f"decoder.layers.{moe}.mlp.experts.linear_fc1.weight0" in te
    assert got["te_received"].keys() == got["received"].keys()
    for name, ref in got["received"].items():
        assert torch.equal(got["te_received"][name], ref), name


def test_model_built_without_its_configs_layer_pattern_is_refused_naming_the_layer(single):
    message = single["mixed"]["not built"]
    assert message == (
        "decoder.layers.0 is an MoE layer, but moe_layer_freq=[0, 1] makes it a dense MLP layer: build the model "
        "with its config's layer pattern (megatron-core's get_gpt_decoder_block_spec(config, ...))"
    ), message


def test_te_grouped_gemm_names_export_exactly_the_sequential_tensors(single):
    """TEGroupedMLP's per-expert weights and TE's fused layernorm name, on the same
    model (TE cannot run on CPU): the HF tensors equal the SequentialMLP export's,
    bit for bit, and the logits still match."""
    g = single["grouped"]
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in g["names"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in g["names"]
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in g["names"]
    assert not any("local_experts" in n or "input_layernorm" in n for n in g["names"])
    assert g["received"].keys() == single["received"].keys()
    for name, ref in single["received"].items():
        assert torch.equal(g["received"][name], ref), name
    # Same per-expert names, in the same order, gathered by EP rank 0 (single rank); the reshard layout agrees.
    assert g["plan"]["names"] == single["plan"]["names"] == g["layout_names"]
    assert g["expert_order"] == g["sequential_order"]
    assert g["plan"]["owners"] == single["plan"]["owners"]
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in g["owners"]
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in g["layout_experts"]
    assert g["result"].applied == (1,)
    assert g["same_logits"]
    assert g["verify"].max_abs_diff < 1e-4 and abs(g["verify"].kl) < 1e-6, g["verify"]


# ------------------------------------------------------------------ multi rank


def _count_collectives(counts):
    """Wrap the torch.distributed collectives a gather could use; returns an undo callable."""
    saved = {n: getattr(dist, n) for n in ("all_gather_into_tensor", "all_gather", "gather", "broadcast")}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            counts.append((name, tuple(dist.get_process_group_ranks(group)) if group is not None else None))
            return fn(*args, **kwargs)

        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    return lambda: [setattr(dist, n, fn) for n, fn in saved.items()]


def _export_case(tp, pp, ep, target, transport, te_grouped=False, etp=1, freq=1):
    """One trainer layout exporting versions 7 and 8; returns what the tests check.
    ``te_grouped``: the model's parameters under TE / TEGroupedMLP names; ``etp``: expert TP;
    ``freq``: ``moe_layer_freq`` (dense layers where it says 0; they refit colocated engines too)."""
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    cfg = tiny_llama.transformer_config(SPEC, tp=tp, pp=pp, ep=ep, expert_tensor_parallel_size=etp, moe_layer_freq=freq)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    model = tiny_llama.build_model(SPEC, cfg, device=device)
    if te_grouped:
        tiny_llama.as_te_grouped_moe(model)
    hf, receiver = None, None
    if transport == "inprocess" and dist.get_rank() == 0:  # the export rank
        hf = tiny_llama.hf_model(SPEC, tiny_llama.transformer_config(SPEC, moe_layer_freq=freq))
        receiver = wx.WeightReceiver(wx.HFModelConsumer(hf))
    exporter = wx.WeightExporter(
        model,
        wx.RefitConfig(
            target=target,
            transport=transport,
            backend="gloo",
            bucket_size_mb=BUCKET_MB,
            vocab_size=SPEC.hf_vocab_size,
            timeout_s=60,
        ),
        receiver=receiver,
    )
    first = exporter.export(version=7)
    with torch.no_grad():  # a training step's worth of change; the plan is not re-sent
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    counts = []
    undo = _count_collectives(counts)
    try:
        second = exporter.export(version=8)
    finally:
        undo()
    verify = exporter.verify(tiny_llama.tokens(SPEC)) if pp == 1 else None
    lay = exporter.mesh
    out = dict(
        first=first,
        second=second,
        verify=verify,
        counts=counts,
        plan=_plan_summary(exporter.plan) if exporter.participates else None,
        where=dict(
            pp=lay.pp_rank,
            dp=lay.dp_rank,
            edp=lay.edp_rank,
            tp=tp,
            ep=ep,
            etp=etp,
            tp_group=tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
            ep_group=tuple(dist.get_process_group_ranks(ps.get_expert_model_parallel_group())),
            etp_ep_group=tuple(dist.get_process_group_ranks(ps.get_expert_tensor_and_model_parallel_group())),
        ),
        expected=moe_full_state(model),
        layout_names=_layout_names(cfg),
        received=hf_checkpoint_names(dict(hf.named_parameters())) if hf is not None else None,
    )
    out["reshard"] = _reshard_layout_check(model, tp=tp, pp=pp, ep=ep, etp=etp)
    if etp > 1 or freq != 1:
        out["refit"] = _colocated_refit(model, tp=tp, ep=ep, etp=etp)
    exporter.close()
    if exporter.is_export_rank:  # ipc-direct maps only the export rank's storage: refused with EP > 1
        direct = wx.WeightExporter(model, wx.RefitConfig(target="127.0.0.1:9", transport="ipc-direct"))
        try:
            out["ipc_direct"] = f"no error: {direct.sender}"
        except ValueError as exc:
            out["ipc_direct"] = str(exc)
    ps.destroy_model_parallel()
    return out


def _reshard_layout_check(model, *, tp, pp, ep, etp):
    """The reshard trainer layout (``megatron_layout`` with this job's TP/PP/DP/EP/ETP)
    against this rank's real parameters: names and shapes, and the rank's
    ``(ep_rank, etp_rank)`` from parallel_state."""
    from megatron.core import parallel_state as ps

    from megatron_ext.sharding import megatron_expert_coords, megatron_layout, specs_from_model
    from megatron_ext.weight_export.exec.reshard import megatron_tensors

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = megatron_layout(
        specs_from_model(model, vocab_size=SPEC.hf_vocab_size), tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, etp=etp
    )
    params = megatron_tensors(model)
    return dict(
        layout={n: lt.shape for n, lt in layout.tensors[rank].items()},
        params={n: tuple(t.shape) for n, t in params.items()},
        coords=(ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()),
        layout_coords=megatron_expert_coords(rank, tp=tp, dp=world // (tp * pp), ep=ep, etp=etp),
    )


# Engines colocated on the trainer's 4 ranks; both need bytes from other ranks: TP2 x DP2 takes experts
# of the other EP rank (expert-TP shards as they are), TP1 x DP4 x EP2 whole experts and whole dense tensors.
ENGINES = {"tp2_dp2": dict(tp=2, dp=2), "tp1_dp4_ep2": dict(tp=1, dp=4, ep=2)}


def _colocated_refit(model, *, tp, ep, etp):
    """A ReshardExecutor refit from this job's trainer layout to each engine of
    ``ENGINES`` on the same ranks (NaN before); returns this rank's engine tensors and stats."""
    from megatron_ext.sharding import megatron_layout, specs_from_model
    from megatron_ext.weight_export.plan.layout import inference_layout
    from megatron_ext.weight_export.exec.reshard import ReshardExecutor, megatron_tensors
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    specs = specs_from_model(model, vocab_size=SPEC.hf_vocab_size)
    src = megatron_layout(specs, tp=tp, dp=world // tp, ep=ep, etp=etp)
    trainer = megatron_tensors(model)
    out = {}
    for key, engine in ENGINES.items():
        dst = inference_layout(specs, **engine)
        tensors = {n: torch.full(lt.shape, float("nan"), dtype=lt.dtype) for n, lt in dst.tensors[rank].items()}
        stats = ReshardExecutor(
            build_reshard_plan(src, dst), rank, {**trainer, **tensors}, bucket_bytes=4096, max_inflight=2
        ).refit(1)
        out[key] = dict(tensors=tensors, stats=stats)
    return out


def _trainer(cases):
    return {key: _export_case(*args) for key, args in cases.items()}


def _check_case(out, key, received_params=None, moe_layers=range(SPEC.num_layers)):
    ranks = [o[key] for o in out]
    export_rank = ranks[0]
    assert export_rank["first"].applied == (7,) and export_rank["second"].applied == (8,), export_rank["second"]
    expected = _reference(export_rank["expected"])
    layer = moe_layers[0]
    assert not torch.equal(
        expected[f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"],
        expected[f"model.layers.{layer}.mlp.experts.2.gate_proj.weight"],
    ), "experts must differ per EP rank"
    got = export_rank["received"] if received_params is None else hf_checkpoint_names(received_params)
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        assert torch.equal(got[name], ref), f"{key}: {name}"
    plan = export_rank["plan"]
    assert plan["names"] == export_rank["layout_names"]
    num_local = SPEC.num_moe_experts // export_rank["where"]["ep"]
    assert plan["owners"] == {e: e // num_local for e in range(SPEC.num_moe_experts)}
    etp = export_rank["where"]["etp"]
    assert plan["etp_size"] == etp
    # Which (EP, expert-TP) rank holds which slice: fc1 split on rows, fc2 on columns (whole with ETP 1).
    assert plan["holders"] == {
        (layer, e, fc): (tuple((e // num_local, k) for k in range(etp)), None if etp == 1 else int(fc == "linear_fc2"))
        for layer in moe_layers
        for e in range(SPEC.num_moe_experts)
        for fc in ("linear_fc1", "linear_fc2")
    }
    if export_rank["verify"] is not None:
        assert export_rank["verify"].max_abs_diff < 1e-4 and abs(export_rank["verify"].kl) < 1e-6
    # One all_gather_into_tensor per bucket in the bucket's group (experts: the EP group, with expert
    # TP the ETP x EP group), nothing per parameter.
    for rank, r in enumerate(ranks):
        w = r["where"]
        expert_group = w["ep_group"] if w["etp"] == 1 else w["etp_ep_group"]
        assert len(expert_group) == w["ep"] * w["etp"]
        want = []
        for pp_rank, group, _owners in plan["groups"]:
            size = w["tp"] if group == "tp" else w["ep"] * w["etp"]
            gathers = w["dp"] == 0 if group == "tp" else w["edp"] == 0
            if pp_rank == w["pp"] and gathers and size > 1:
                want.append(("all_gather_into_tensor", w["tp_group"] if group == "tp" else expert_group))
        assert r["counts"] == want, f"{key} rank {rank}: {r['counts']} != {want}"
    ep = export_rank["where"]["ep"]
    assert any(group == "ep" and owners > ep for _, group, owners in plan["groups"]), (
        "no expert bucket holds more than one expert weight per EP rank: the collective count shows nothing"
    )


@pytest.mark.parametrize(
    "backend,transport,receiver_device",
    [
        ("gloo", "broadcast", "cpu"),
        # NCCL expert gather on GPUs 0-1; CUDA IPC into a receiver sharing GPU 0 with the export rank.
        pytest.param("nccl", "ipc", "cuda:0", marks=pytest.mark.gpus(2)),
    ],
    ids=["gloo-broadcast", "nccl-ipc"],
)
def test_ep2_trainer_streams_experts_to_hf_receiver_process(backend, transport, receiver_device):
    """TP1 x DP2 x EP2: rank 1 (DP rank 1) holds experts 2, 3 and joins only the expert gathers."""
    with start_hf_receiver(tiny_llama.build_hf, (SPEC,), device=receiver_device) as receiver:
        out = run_on_ranks(
            _trainer,
            2,
            args=({"ep2": (1, 1, 2, receiver.address, transport)},),
            backend=backend,
            timeout=TIMEOUT,
            watch=receiver.failure,
        )
        got = receiver.result()
    assert got["ok"], got.get("error")
    assert got["applied"] == [7, 8] and got["plans"] == 1
    _check_case(out, "ep2", got["state"])
    assert out[1]["ep2"]["counts"], "rank 1 must send its experts"
    assert "needs TP=PP=EP=ETP=1" in out[0]["ep2"]["ipc_direct"] and "EP=2" in out[0]["ep2"]["ipc_direct"]


def test_tp2_ep2_and_pp2_ep2_trainers_export_every_expert():
    """4 ranks, four layouts one after the other, each into an HF model on the export
    rank: TP2 x EP2 (expert-DP 2: ranks 2, 3 gather nothing), PP2 x EP2, TP2 x EP2
    again with the parameters under TE's names (TEGroupedMLP experts), which must
    export exactly the TP2 x EP2 tensors, and TP2 x EP2 with expert TP 2 (each
    expert split over two ranks; all four ranks join the expert gathers), whose
    ranks then refit colocated engines with ReshardExecutor, and TP2 x EP2 with a dense first layer
    (moe_layer_freq [0, 1], DeepSeek-V3 style: a Qwen3-MoE with mlp_only_layers [0]), refitting them too."""
    cases = {
        "tp2_ep2": (2, 1, 2, None, "inprocess"),
        "pp2_ep2": (1, 2, 2, None, "inprocess"),
        "tp2_ep2_te_grouped": (2, 1, 2, None, "inprocess", True),
        "tp2_ep2_etp2": (2, 1, 2, None, "inprocess", False, 2),
        "tp2_ep2_dense_first": (2, 1, 2, None, "inprocess", False, 1, [0, 1]),
    }
    out = run_on_ranks(_trainer, 4, args=(cases,), backend="gloo", timeout=TIMEOUT)
    for case in cases:
        _check_case(out, case, moe_layers=[1] if case == "tp2_ep2_dense_first" else range(SPEC.num_layers))
        assert [bool(o[case]["counts"]) for o in out] == (
            [True, True, False, False]
            if case.startswith("tp2_ep2") and "etp2" not in case
            else [True, True, True, True]
        )
    sequential, grouped = out[0]["tp2_ep2"]["received"], out[0]["tp2_ep2_te_grouped"]["received"]
    assert grouped.keys() == sequential.keys()
    for name, ref in sequential.items():
        assert torch.equal(grouped[name], ref), name
    # Expert TP 2: the expert buckets' gather spans all four ranks (ETP x EP), the dense ones TP only;
    # tiny_llama builds the same global model at ETP 1 and 2, so the exports agree bit for bit.
    etp2 = out[0]["tp2_ep2_etp2"]
    assert etp2["received"].keys() == sequential.keys()
    for name, ref in sequential.items():
        assert torch.equal(etp2["received"][name], ref), name
    assert ("all_gather_into_tensor", (0, 1, 2, 3)) in etp2["counts"]
    assert ("all_gather_into_tensor", (0, 1)) in etp2["counts"]
    # The reshard trainer layout of each job: every rank's local tensors are its real parameters
    # (names, shapes; SequentialMLP and TEGroupedMLP), its (EP, expert-TP) rank is parallel_state's,
    # and a ReshardExecutor refit from the TP2 x EP2 x ETP2 job gives colocated engines exactly the HF bytes.
    for case in cases:
        for rank, o in enumerate(out):
            r = o[case]["reshard"]
            assert r["layout"].keys() == r["params"].keys(), f"{case} rank {rank}"
            for n, shape in r["layout"].items():  # the last vocabulary shard keeps only the HF rows
                vocab = n in ("embedding.word_embeddings.weight", "output_layer.weight")
                assert shape == r["params"][n] or vocab and shape[1:] == r["params"][n][1:], (case, rank, n)
            assert r["layout_coords"] == r["coords"], f"{case} rank {rank}"
    assert [o["tp2_ep2_etp2"]["reshard"]["coords"] for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [o["tp2_ep2"]["reshard"]["coords"] for o in out] == [(0, 0), (1, 0), (0, 0), (1, 0)]
    _check_colocated_refit(out, "tp2_ep2_etp2", tp=2, ep=2, etp=2)
    # the dense first layer: its MLP under the dense names, TP-split (not gathered over EP), on every engine
    dense = out[0]["tp2_ep2_dense_first"]
    assert "model.layers.0.mlp.gate_proj.weight" in dense["received"]
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in dense["received"])
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in dense["received"]
    assert dense["received"]["model.layers.0.mlp.gate_proj.weight"].shape == (SPEC.ffn_hidden_size, SPEC.hidden_size)
    _check_colocated_refit(out, "tp2_ep2_dense_first", tp=2, ep=2, etp=1, freq=[0, 1])
    for r, o in enumerate(out):  # engine TP2 x DP2: rank r's TP shard of layer 0's fused [gate; up]
        got = o["tp2_ep2_dense_first"]["refit"]["tp2_dp2"]["tensors"]["model.layers.0.mlp.gate_up_proj.weight"]
        assert got.shape == (SPEC.ffn_hidden_size, SPEC.hidden_size), (r, got.shape)


def _check_colocated_refit(out, case, *, tp, ep, etp, freq=1):
    """Every engine rank's tensors after the refit equal the HF reference of the
    trainer's parameters (gathered independently), with no NaN left."""
    from megatron_ext.sharding import specs_from_config
    from megatron_ext.weight_export.plan.layout import inference_layout

    cfg = tiny_llama.transformer_config(SPEC, tp=tp, ep=ep, expert_tensor_parallel_size=etp, moe_layer_freq=freq)
    specs = specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)
    ref = _reference(out[0][case]["expected"])
    for key, engine in ENGINES.items():
        dst = inference_layout(specs, **engine)
        assert dst.ranks == tuple(range(len(out)))
        assert {s.name for r in dst.ranks for lt in dst.tensors[r].values() for s in lt.segments} == ref.keys()
        for r in dst.ranks:
            got = out[r][case]["refit"][key]["tensors"]
            assert got.keys() == dst.tensors[r].keys(), f"{key} rank {r}"
            for n, lt in dst.tensors[r].items():
                assert not got[n].isnan().any(), f"{key} rank {r} {n}: NaN left"
                want = torch.cat([ref[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments])
                assert torch.equal(got[n], want), f"{key} rank {r} {n}"
        stats = [o[case]["refit"][key]["stats"] for o in out]
        assert all(s.received_bytes > 0 and s.rounds > 1 for s in stats), (key, stats)


# ------------------------------------------------- plans without a process group
def _moe_specs():
    from megatron_ext.sharding import gpt_specs

    return gpt_specs(
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_groups=2,
        head_dim=8,
        ffn_hidden_size=32,
        vocab_size=64,
        num_experts=4,
        moe_ffn_hidden_size=16,
        dtype=torch.float32,
    )


@pytest.mark.parametrize("etp", [1, 2])
def test_expert_buckets_alternate_ep_ranks_and_expert_tp_slices_reassemble(etp):
    """EP2 (x ETP): expert buckets apart from dense ones, consecutive expert tensors from
    alternating EP ranks (equal gather slots), each expert's slices on its (EP, expert-TP)
    ranks (fc1 rows as [gate_r; up_r], fc2 columns); and hand-made Megatron shards
    placed by the plan's transfers give back the whole HF experts."""
    from megatron_ext.sharding import megatron_layout
    from megatron_ext.weight_export.plan.export_plan import build_plan, members, stage_ranks
    from megatron_ext.weight_export.plan.reshard_plan import run_view

    specs = _moe_specs()
    plan = build_plan(specs, 2 * 16 * 16 * 4, tp=2, ep=2, etp=etp)  # two fp32 expert tensors per bucket
    experts = [b for b in plan.buckets if b.group == "ep"]
    assert [b.group for b in plan.buckets] == ["tp"] * (len(plan.buckets) - len(experts)) + ["ep"] * len(experts)
    gatherers = members("ep", 0, tp=2, ep=2, etp=etp)
    summary = _plan_summary(plan)
    assert summary["owners"] == {e: e // 2 for e in range(4)}
    assert summary["holders"] == {
        (0, e, fc): (tuple((e // 2, k) for k in range(etp)), None if etp == 1 else int(fc == "linear_fc2"))
        for e in range(4)
        for fc in ("linear_fc1", "linear_fc2")
    }
    for b in experts:
        sent = {m: sum(t.nbytes for t in b.transfers if t.src == m) for m in gatherers}
        assert len(set(sent.values())) == 1, f"bucket {b.index}: unequal slots {sent}"
    # Megatron's shards of the trainer layout, built by hand from whole HF experts.
    whole = {s.name: torch.randn(s.shape) for s in specs}
    layout = megatron_layout(specs, tp=2, dp=stage_ranks(2, 2, etp) // 2, ep=2, etp=etp)
    local = {}
    for m in gatherers:
        ep_rank, etp_rank = divmod(m, etp)
        for j in range(2):
            e, pre = ep_rank * 2 + j, f"decoder.layers.0.mlp.experts.local_experts.{j}."
            hf = f"model.layers.0.mlp.experts.{e}."
            local[m, pre + "linear_fc1.weight"] = torch.cat(
                [whole[hf + "gate_proj.weight"].chunk(etp)[etp_rank], whole[hf + "up_proj.weight"].chunk(etp)[etp_rank]]
            )
            local[m, pre + "linear_fc2.weight"] = whole[hf + "down_proj.weight"].chunk(etp, 1)[etp_rank].contiguous()
            for name in ("linear_fc1.weight", "linear_fc2.weight"):
                assert tuple(local[m, pre + name].shape) == layout.tensors[m][pre + name].shape
    got = {t.name: torch.full(t.shape, float("nan")) for b in experts for t in b.tensors}
    for b in experts:
        for t in b.transfers:
            got[t.name][t.box.slices] = run_view(local[t.src, t.src_run.local], t.src_run).view(t.box.shape)
    for name, tensor in got.items():
        assert torch.equal(tensor, whole[name]), name


def test_hf_config_for_qwen3_moe_checks_routing_and_maps_dense_layers():
    from megatron_ext.weight_export import hf_config_from_megatron

    cfg = tiny_llama.transformer_config(SPEC)
    hf = hf_config_from_megatron(cfg, arch="qwen3_moe", vocab_size=120)
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob) == (4, 2, 32, True)
    assert hf.mlp_only_layers == []
    mixed = dataclasses.replace(cfg, moe_layer_freq=[0, 1], moe_router_pre_softmax=True)
    hf = hf_config_from_megatron(mixed, arch="qwen3_moe", vocab_size=120)
    assert hf.mlp_only_layers == [0] and hf.norm_topk_prob is False
    with pytest.raises(ValueError, match="moe_router_topk_scaling_factor"):
        hf_config_from_megatron(
            dataclasses.replace(cfg, moe_router_topk_scaling_factor=2.0), arch="qwen3_moe", vocab_size=120
        )
    for balancing in ("sinkhorn", "quantile_balancing"):  # routed otherwise at inference
        with pytest.raises(ValueError, match="moe_router_load_balancing_type=.*use aux_loss, seq_aux_loss"):
            hf_config_from_megatron(
                dataclasses.replace(cfg, moe_router_load_balancing_type=balancing), arch="qwen3_moe", vocab_size=120
            )
    with pytest.raises(ValueError, match="arch='qwen3_moe'"):
        hf_config_from_megatron(cfg, arch="qwen3", vocab_size=120)
    # a moe_layer_freq the pattern cannot be read from: refused by the specs and the HF config alike, naming it
    from megatron_ext.sharding import specs_from_config

    bad = "moe_layer_freq=[1] is not supported: give an int > 0 or a list of 2 0/1 entries"
    for make in (
        lambda c: specs_from_config(c, vocab_size=120),
        lambda c: hf_config_from_megatron(c, arch="qwen3_moe", vocab_size=120),
    ):
        with pytest.raises(ValueError, match=re.escape(bad)):
            make(dataclasses.replace(cfg, moe_layer_freq=[1]))
