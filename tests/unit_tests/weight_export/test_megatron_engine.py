"""megatron-core's own inference engine (``megatron.core.inference``: StaticInferenceEngine,
TextGenerationController, GPTInferenceWrapper) as the target of the reshard refit, in a job of
its own: a trainer job (2 ranks) and an engine job (2 ranks) over one RefitGroup, at trainer
TP2 -> engine TP1 x DP2 and trainer TP1 x DP2 -> engine TP2 (the tiny Llama: GQA, SwiGLU,
RoPE, padded vocabulary), and for the tiny Qwen3-MoE (4 SequentialMLP experts, top-2, qk-norm)
trainer TP2 x EP2 -> engine TP1 x DP2 x EP2 (whole experts per engine rank) and trainer
TP1 x DP2 x EP2 -> engine TP2 x EP1 (every expert TP-sharded over both engine ranks), and the same with a dense
first layer (moe_layer_freq [0, 1], DeepSeek-V3 style: its MLP TP-sharded on both sides). After each
version the engine's greedy tokens equal a plain greedy loop over the trainer model's forward,
its logits pass the KL gate against the trainer's (also as the RefitGate inside the refit:
``refit(verify=gate)`` in the first case of each kind, ``serve(verify=gate)`` in the second), and
its parameters gathered to TP1 (MoE: every expert under its global index) equal the trainer's bit
for bit, padded vocabulary rows included; before the first refit (other weights) they do not.
The trainer publishes the engine's model config (that of the engine's GPTModel) and layout. An
engine model with another padded vocabulary is refused on every rank of both jobs, naming the
tensor; a trainer that cannot build its side publishes why, and the engine reads it."""

import dataclasses
import io

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import free_port, run_on_ranks, run_two_jobs

from ._reference import gather_tp, moe_full_state

SPEC = tiny_llama.TinyLlamaSpec()  # llama: GQA (4 heads, 2 groups), SwiGLU, RoPE; 128 padded rows for 120 tokens
MOE_SPEC = tiny_llama.TinyLlamaSpec(arch="qwen3_moe")  # + qk-norm, 4 experts (ffn 32), top-2 softmax router
MIXED_SPEC = tiny_llama.TinyLlamaSpec(arch="qwen3_moe", moe_layer_freq=(0, 1))  # layer 0 a dense MLP (ffn 96)
PROMPTS = [[3, 17, 5, 9, 60], [11, 2, 40], [7, 7, 101, 33, 2, 90, 14]]  # different lengths: one static batch
NEW_TOKENS = 6
BUCKET = 4096  # small buckets: many rounds
# (spec, trainer TP, trainer EP, engine TP, engine EP); each job has 2 ranks, so a TP1 side runs 2 DP replicas.
# Expert TP: the trainer's 1 (tiny_llama); the engine's engine_expert_tp: 1 at EP2 (whole experts), its TP at EP1.
CASES = (
    (SPEC, 2, 1, 1, 1),
    (SPEC, 1, 1, 2, 1),
    (MOE_SPEC, 2, 2, 1, 2),
    (MOE_SPEC, 1, 2, 2, 1),
    (MIXED_SPEC, 1, 2, 2, 1),
)
REFUSALS = 1  # the case after which the refusals run (dense, engine TP2)
EMBED = "embedding.word_embeddings.weight"
SHARP = {"init_method_std": 0.1}  # larger weights, peaked logits: a wrong tensor changes the tokens


def _dispatcher(spec, backend):
    """MoE token dispatcher: allgather on gloo (megatron-core's alltoall dispatcher passes its split sizes as
    tensors, which gloo's all_to_all_single does not take), alltoall on NCCL: both dispatchers the engine builds."""
    return {"moe_token_dispatcher_type": "alltoall"} if spec.arch == "qwen3_moe" and backend == "nccl" else {}


def _device(backend):
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _tokens():
    return tiny_llama.tokens(SPEC, batch=2)


def _label(case):
    spec, tp, ep, engine_tp, engine_ep = CASES[case]
    mixed = f" (moe_layer_freq {list(spec.moe_layer_freq)})" if spec.moe_layer_freq != 1 else ""
    return f"{spec.arch}{mixed} trainer TP{tp} x EP{ep} -> engine TP{engine_tp} x EP{engine_ep}"


def _parallel(tp, ep, etp=1):
    """initialize_model_parallel at TP ``tp``, EP ``ep``, expert TP ``etp``; the model's TransformerConfig overrides."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    return {"expert_tensor_parallel_size": etp} if ep > 1 or etp > 1 else {}


def _greedy(model, prompts, n):
    """A plain greedy loop over the model's forward (no KV cache): the argmax over all of
    Megatron's vocabulary rows, as megatron-core's top_k=1 does. Collective over TP."""
    from megatron_ext.weight_export import megatron_logits

    out = []
    for p in prompts:
        seq = torch.tensor([p])
        for _ in range(n):
            seq = torch.cat([seq, megatron_logits(model, seq)[:, -1].argmax(-1, keepdim=True).cpu()], dim=1)
        out.append(seq[0, len(p) :].tolist())
    return out


def _logits_key(case, version):
    return f"test/logits/{case}/{version}"


def _to_bytes(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _from_bytes(raw):
    return torch.load(io.BytesIO(raw))


def _tp1_state(model):
    """Every parameter gathered to its TP1 tensor (one plain all_gather each), on CPU; an MoE model's
    experts gathered over expert TP and EP, under their global index (_reference.moe_full_state)."""
    if model.config.num_moe_experts:
        return moe_full_state(model)
    return {n: gather_tp(n, p).to("cpu", copy=True) for n, p in model.named_parameters()}


def _trainer_body(backend, port, n_engine):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.weight_export.megatron_refit import megatron_trainer_refit

    world, rank = dist.get_world_size(), dist.get_rank()
    group = wx.RefitGroup.join("127.0.0.1", port, rank, world + n_engine, backend=backend, timeout_s=60)
    out = {}
    for case, (spec, tp, ep, engine_tp, engine_ep) in enumerate(CASES):
        etp = _parallel(tp, ep)
        cfg = tiny_llama.transformer_config(spec, tp=tp, ep=ep, **etp, **_dispatcher(spec, backend), **SHARP)
        model = tiny_llama.build_model(spec, cfg, device=_device(backend))
        refit = megatron_trainer_refit(
            model,
            group,
            engine_tp=engine_tp,
            engine_dp=n_engine // engine_tp,
            engine_ep=engine_ep,
            bucket_bytes=BUCKET,
        )
        for version in (1, 2):
            if version == 2:
                gen = torch.Generator().manual_seed(7)  # the next version: the same noise on every replica
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.05)
            logits = wx.megatron_logits(model, _tokens()).cpu()
            if rank == 0:  # the engine's refit gate compares its logits with these
                group.store.set(_logits_key(case, version), _to_bytes(logits))
            out[case, version] = {
                "tokens": _greedy(model, PROMPTS, NEW_TOKENS),
                "logits": logits,
                "state": _tp1_state(model),
                "stats": refit.refit(version),
                "acks": refit.engine_versions(),
            }
        refit.close()  # the engine's serve() returns
        if case == REFUSALS:  # an engine model with another padded vocabulary: refused everywhere
            try:
                megatron_trainer_refit(model, group, engine_tp=engine_tp, engine_dp=1, bucket_bytes=BUCKET)
                out["refused"] = None
            except wx.RefitRejected as e:
                out["refused"] = (e.reason, str(e))
            try:  # a trainer side that cannot be built (5 engine replicas do not fit the group): the engine is told
                megatron_trainer_refit(model, group, engine_tp=1, engine_dp=5, bucket_bytes=BUCKET)
                out["trainer error"] = None
            except ValueError as e:
                out["trainer error"] = str(e)
        ps.destroy_model_parallel()
    group.close()
    return out


def _engine_body(backend, port, n_trainer):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.testing import cpu_compat
    from megatron_ext.weight_export.engines.megatron import MegatronEngine
    from megatron_ext.weight_export.megatron_refit import MegatronEngineRefit
    from megatron_ext.weight_export.engines.megatron_config import (
        engine_expert_tp,
        megatron_model_config,
        megatron_model_problem,
        receive_model_config,
    )

    cpu_compat.install_inference()  # CPU only: megatron-core's static inference path's torch.cuda calls
    world = dist.get_world_size()
    rank = n_trainer + dist.get_rank()  # refit rank
    group = wx.RefitGroup.join("127.0.0.1", port, rank, n_trainer + world, backend=backend, timeout_s=60)
    out = {}
    for case, (spec, _, _, tp, ep) in enumerate(CASES):
        etp = _parallel(tp, ep, engine_expert_tp(tp, ep))
        engine_spec = dataclasses.replace(spec, seed=spec.seed + 1)  # the engine starts from other weights
        cfg = tiny_llama.transformer_config(engine_spec, tp=tp, ep=ep, **etp, **_dispatcher(spec, backend), **SHARP)
        model = tiny_llama.build_model(engine_spec, cfg, device=_device(backend))
        engine = MegatronEngine(model, max_batch_size=4, max_sequence_length=32)

        def observe(engine=engine, model=model):  # every engine rank (collective over the engine's TP)
            return {
                "tokens": engine.generate(PROMPTS, NEW_TOKENS),
                "logits": engine.logits(_tokens()).cpu(),
                "state": _tp1_state(model),
                "version": engine.version,
            }

        out[case, None] = observe()  # the engine's own weights, before any refit
        published = receive_model_config(group)  # what megatron_trainer_refit published: this engine's model
        out[case, "published"] = (
            megatron_model_problem(published, tp, ep),
            published.get("engine"),
            published["config"] == megatron_model_config(model)["config"],
        )
        out[case, "moe_layer_freq"] = published["config"]["moe_layer_freq"]  # one 0 (dense) or 1 (MoE) per layer
        refit = MegatronEngineRefit(group, engine, bucket_bytes=BUCKET)
        # the KL gate inside the refit: the engine's logits against the trainer's (published through the store)
        gate = wx.RefitGate(
            engine, _tokens(), lambda v, case=case: _from_bytes(group.store.get(_logits_key(case, v))), load=False
        )
        if case % 2 == 0:  # one refit() at a time, then serve() until the trainer's close
            for _ in (1, 2):
                stats = refit.refit(verify=gate)  # the announced version
                out[case, stats.version] = {**observe(), "stats": stats}
            out[case, "served"] = refit.serve()  # returns at the trainer's close
        else:  # serve() with the gate at every version, the engine observed after each

            def report(stats, case=case, observe=observe):
                out[case, stats.version] = {**observe(), "stats": stats}

            out[case, "served"] = refit.serve(report, verify=gate)
        if case == REFUSALS:
            bad_spec = dataclasses.replace(engine_spec, vocab_size=256)  # padded to 256 rows, the trainer has 128
            bad = MegatronEngine(tiny_llama.build_model(bad_spec, cfg, device=_device(backend)))
            receive_model_config(group)
            try:
                MegatronEngineRefit(group, bad, bucket_bytes=BUCKET)
                out["refused"] = None
            except wx.RefitRejected as e:
                out["refused"] = (e.reason, str(e))
            out["trainer error"] = megatron_model_problem(receive_model_config(group), tp)
        ps.destroy_model_parallel()
    group.close()
    return out


def _run_both(backend, n_trainer=2, n_engine=2, timeout=240):
    """The trainer job and the engine job, each its own run_on_ranks world, at the same time."""
    port, nccl = free_port(), backend == "nccl"
    return run_two_jobs(
        dict(fn=_trainer_body, world_size=n_trainer, args=(backend, port, n_engine), backend=backend,
             timeout=timeout, env={"CUDA_VISIBLE_DEVICES": "0,1"} if nccl else None),
        dict(fn=_engine_body, world_size=n_engine, args=(backend, port, n_trainer), backend=backend,
             timeout=timeout, env={"CUDA_VISIBLE_DEVICES": "2,3"} if nccl else None),
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(4))])
def test_megatron_engine_refit(backend, monkeypatch):
    from megatron_ext.weight_export import verify_export

    monkeypatch.setenv("TQDM_DISABLE", "1")  # megatron-core's static engine draws a progress bar per batch
    trainer, engine = _run_both(backend)
    for case, (spec, _, _, engine_tp, engine_ep) in enumerate(CASES):
        label = _label(case)
        engine_layout = {
            "tp": engine_tp,
            "dp": 2 // engine_tp,
            "ep": engine_ep,
            "etp": 1 if engine_ep > 1 else engine_tp,
        }
        ref = {v: trainer[0][case, v] for v in (1, 2)}
        assert ref[1]["tokens"] != ref[2]["tokens"], label  # the two versions generate differently
        for t in trainer:
            assert t[case, 1]["tokens"] == ref[1]["tokens"]  # every trainer rank ran the same model
            assert t[case, 1]["acks"] == {2: 1, 3: 1} and t[case, 2]["acks"] == {2: 2, 3: 2}, label
        for r, res in enumerate(engine):
            who = f"{label}, engine rank {r}"
            before = res[case, None]
            assert before["tokens"] != ref[1]["tokens"], who  # other weights: other tokens
            assert not verify_export(ref[1]["logits"], before["logits"]).ok(max_kl=1e-3), who
            assert res[case, "served"] == 2, who
            # the trainer published this engine's model (the same config as the engine's GPTModel) and layout
            assert res[case, "published"] == (None, engine_layout, True), who
            if spec.arch == "qwen3_moe":
                assert res[case, "moe_layer_freq"] == [int(spec.moe_layer_freq != (0, 1)), 1], who
                dense = [n for n in res[case, 1]["state"] if n.startswith("decoder.layers.0.mlp.linear_fc")]
                assert len(dense) == 2 * (spec is MIXED_SPEC), (who, dense)  # the dense layer's fc1 and fc2
            for v in (1, 2):
                got = res[case, v]
                stats = got["stats"]
                assert got["version"] == v and stats.version == v and stats.received_bytes > 0, who
                assert stats.gate_ok and stats.kl < 1e-3, (who, v, stats)  # the gate ran in the refit
                # what a user checks: the engine's greedy tokens are the trainer's ...
                assert got["tokens"] == ref[v]["tokens"], (who, v, got["tokens"], ref[v]["tokens"])
                # ... its logits pass the KL gate (every padded row compared) ...
                result = verify_export(ref[v]["logits"], got["logits"])
                assert got["logits"].shape == (2, spec.seq_length, spec.vocab_size), who
                assert result.ok(max_kl=1e-3) and result.max_abs_diff < 1e-3, (who, v, result)
                # ... and its parameters are a copy of the trainer's, padded vocabulary rows included
                assert sorted(got["state"]) == sorted(ref[v]["state"]), who
                for n, t in got["state"].items():
                    torch.testing.assert_close(t, ref[v]["state"][n], rtol=0, atol=0, msg=f"{who} v{v} {n}")

    # an engine GPTModel with 256 padded vocabulary rows: refused on every rank of both jobs, naming it
    def problem(r):
        return (
            f"engine refit rank {r}: {EMBED} is (128, {SPEC.hidden_size}), the trainer's model at engine TP2 is "
            f"(64, {SPEC.hidden_size})"
        )

    for r, res in enumerate([*trainer, *engine]):
        reason, msg = res["refused"]
        assert reason == "tensors", (r, msg)
        if r < len(trainer):
            assert "refit ranks [2, 3] cannot take part" in msg and problem(2) in msg, (r, msg)
        else:
            assert msg.startswith(problem(r)), (r, msg)
    # a trainer that cannot build its side publishes why instead of its model: the engine reads it at once
    error = "the refit group has 4 ranks; the trainer's 2 + engine_tp=1 x engine_dp=5 make 7"
    assert all(t["trainer error"] == error for t in trainer), [t["trainer error"] for t in trainer]
    for res in engine:
        assert res["trainer error"] == f"the trainer could not build its side of the refit: ValueError: {error}"


def _alltoall_body(backend, dispatcher):
    """Two ranks at TP1 x EP2 (expert TP 1): the tiny Qwen3-MoE with ``dispatcher`` as a trainer holds it, the
    engine's GPTModel built from its published config in the same parallel state, the trainer's weights copied in
    by name; the engine's greedy tokens and logits against the trainer model's forward."""
    from megatron_ext.testing import cpu_compat
    from megatron_ext.weight_export import megatron_logits, verify_export
    from megatron_ext.weight_export.engines.megatron import MegatronEngine
    from megatron_ext.weight_export.engines.megatron_config import (
        build_engine_model,
        megatron_model_config,
        megatron_model_problem,
    )

    cpu_compat.install_inference()  # CPU only (no-op with CUDA)
    device = _device(backend)
    overrides = _parallel(1, 2)
    cfg = tiny_llama.transformer_config(MOE_SPEC, ep=2, moe_token_dispatcher_type=dispatcher, **overrides, **SHARP)
    trainer = tiny_llama.build_model(MOE_SPEC, cfg, device=device)
    tokens = _tokens()
    logits, greedy = megatron_logits(trainer, tokens).cpu(), _greedy(trainer, PROMPTS, NEW_TOKENS)
    published = megatron_model_config(trainer)
    model = build_engine_model(published, device=device)
    with torch.no_grad():
        for (n, p), (m, q) in zip(model.named_parameters(), trainer.named_parameters(), strict=True):
            assert n == m and p.shape == q.shape, (n, m)
            p.copy_(q)
    engine = MegatronEngine(model, max_batch_size=4, max_sequence_length=32)
    return {
        "problem": megatron_model_problem(published, 1, 2),
        "dispatcher": (published["config"]["moe_token_dispatcher_type"], model.config.moe_token_dispatcher_type),
        "tokens": engine.generate(PROMPTS, NEW_TOKENS),
        "greedy": greedy,
        "gate": verify_export(logits, engine.logits(tokens).cpu()),
    }


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(2))])
def test_moe_engine_runs_the_trainers_alltoall_dispatcher_at_ep2(backend, monkeypatch):
    """megatron-core's alltoall token dispatcher in the engine built from the published config at EP2: the
    trainer model's greedy tokens and logits (on gloo its split sizes reach all_to_all_single as lists:
    cpu_compat)."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = run_on_ranks(_alltoall_body, 2, args=(backend, "alltoall"), backend=backend, timeout=180)
    for r, got in enumerate(out):
        assert got["problem"] is None and got["dispatcher"] == ("alltoall", "alltoall"), (r, got)
        assert got["tokens"] == got["greedy"], (r, got["tokens"], got["greedy"])
        assert got["gate"].ok(max_kl=1e-3) and got["gate"].max_abs_diff < 1e-3, (r, got["gate"])
