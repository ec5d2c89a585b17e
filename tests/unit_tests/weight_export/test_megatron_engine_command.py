"""The trainer and megatron-core's inference engine as two commands of their own, as a user runs them:

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/pretrain_gpt.py ... \\
        --tensor-model-parallel-size 2 --refit-transport p2p --refit-store HOST:PORT --refit-engine megatron \\
        --refit-engine-dp 2 --refit-every-n-steps 3 --save CKPT
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_ext.testing.cpu_engine \\
        --engine megatron --refit-store HOST:PORT --refit-rank-offset 2 --prompt-tokens ... --save-tokens OUT

(``megatron_ext.testing.cpu_engine`` is ``python -m megatron_ext.weight_export.engine`` with
megatron-core's CPU stand-ins installed: the product command refuses ``--engine megatron`` on CPU.)
The trainer runs TP2, the engine TP1 x DP2, and the engine builds its GPTModel from the config the
trainer publishes (no model flags), its weights NaN until a refit writes them. The engine's greedy
tokens after each version are checked against a plain greedy loop over the trainer's weights,
independently of the refit and of megatron-core's inference path: the starting weights (built from
the seed, as the trainer builds them) for version 0, the trainer's final checkpoint (loaded at TP1
by the script's own loader) for the last version. An engine started with another TP than the
trainer's ``--refit-engine-tp`` stops both jobs within seconds, naming the flag; a model the engine
cannot build is refused naming the field (the checks on the config the trainer publishes); bad
flags are refused at parse time."""

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from megatron_ext.testing.multirank import free_port, run_on_ranks
from megatron_ext.weight_export import engine as engine_command
from megatron_ext.weight_export.engines.megatron_config import MODEL_FIELDS, megatron_model_problem

from ..examples.test_pretrain_torchrun import ITERS, MODEL, TRAIN, _env, _script, _start, finish, launch

PROMPTS = [[3, 17, 5, 9, 60], [11, 2, 40], [7, 7, 101, 33, 2, 90, 14]]  # different lengths: one static batch
NEW_TOKENS = 6
EVERY = 3  # refits at start (version 0), after iterations 3 and 6 (the end)
VERSIONS = [0, 3, 6]
BUCKET = "0.004"  # MiB: small buckets, many rounds
SHARP = ["--init-method-std", "0.1"]  # larger weights, peaked logits: a wrong tensor changes the tokens
TP_TRAINER = ["--tensor-model-parallel-size", "2"]
assert ITERS == VERSIONS[-1]


def _engine(nproc: int, store: str, offset: int, *flags: str, env: dict, log: str):
    """The engine command (its CPU entry point) as a torchrun job of ``nproc`` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "megatron_ext.testing.cpu_engine", "--engine", "megatron", "--refit-store", store, "--refit-rank-offset",
           str(offset), "--device", "cpu", *flags]  # fmt: skip
    return _start(cmd, env, log)


def _read(proc) -> str:
    with open(proc.log) as f:
        return f.read()


def _finish_all(procs: dict, timeout: float) -> dict:
    """Wait for every command; a failure shows every command's output (the cause is often the other job's)."""
    try:
        return {what: finish(p, what, timeout=timeout) for what, p in procs.items()}
    except AssertionError as exc:
        others = "\n".join(f"--- {w}:\n{_read(p)[-4000:]}" for w, p in procs.items())
        raise AssertionError(f"{exc}\n{others}") from None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _greedy(model, prompts=PROMPTS, n=NEW_TOKENS):
    """A plain greedy loop over the model's full forward (no KV cache), argmax over all of Megatron's
    padded vocabulary rows as megatron-core's top_k=1; also the smallest top-1 margin it saw."""
    from megatron_ext.weight_export import megatron_logits

    tokens, margin = [], float("inf")
    for p in prompts:
        seq = torch.tensor([p])
        for _ in range(n):
            top = megatron_logits(model, seq)[0, -1].cpu().topk(2)
            margin = min(margin, (top.values[0] - top.values[1]).item())
            seq = torch.cat([seq, top.indices[:1].view(1, 1)], dim=1)
        tokens.append(seq[0, len(p) :].tolist())
    return tokens, margin


def _reference(flags):
    """One rank: the script's model at TP1 from its seed (the trainer's starting weights), then its last
    checkpoint loaded by the script's loader; greedy tokens of both, and the model config the trainer publishes."""
    import types

    from megatron.core import parallel_state as ps

    from megatron_ext.weight_export.engines.megatron_config import megatron_model_config

    script = _script()
    args, plan = script.parse_args([*MODEL, *TRAIN, *flags], world_size=1, cuda=False)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = script.build_model(args, plan, script.transformer_config(args, plan, 1), torch.device("cpu"))
    out = {"config": megatron_model_config(model), "start": _greedy(model)}
    iteration, _ = script.load_checkpoint(args, plan, types.SimpleNamespace(module=model), None, None)
    out["final"], out["iteration"] = _greedy(model), iteration
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Both commands at once, then the reference from the trainer's seed and checkpoint."""
    tmp = str(tmp_path_factory.mktemp("megatron_engine_command"))
    env = _env(tmp)
    store, ckpt, saved = f"127.0.0.1:{free_port()}", os.path.join(tmp, "ckpt"), os.path.join(tmp, "tokens.json")
    log = lambda name: os.path.join(tmp, f"{name}.log")  # noqa: E731
    prompts = [",".join(map(str, p)) for p in PROMPTS]
    procs = {
        "the engine": _engine(2, store, 2, "--prompt-tokens", *prompts, "--generate-tokens", str(NEW_TOKENS),
                              "--save-tokens", saved, "--bucket-size-mb", BUCKET, "--timeout-s", "120",
                              env=env, log=log("engine")),
        "the trainer": launch(2, *SHARP, *TP_TRAINER, "--refit-transport", "p2p", "--refit-store", store,
                              "--refit-engine", "megatron", "--refit-engine-dp", "2", "--refit-every-n-steps",
                              str(EVERY), "--refit-bucket-size-mb", BUCKET, "--save", ckpt, env=env,
                              log=log("trainer")),
    }  # fmt: skip
    out = _finish_all(procs, timeout=240)
    ref = run_on_ranks(_reference, 1, args=(["--load", ckpt, "--no-load-optim", *SHARP],), timeout=120)[0]
    with open(saved) as f:
        tokens = json.load(f)
    return {"trainer": out["the trainer"], "engine": out["the engine"], "tokens": tokens, "ref": ref}


def test_engine_command_serves_each_version_with_the_trainers_tokens(run):
    trainer, engine, tokens, ref = run["trainer"], run["engine"], run["tokens"], run["ref"]
    assert re.search(
        r"refit: p2p to the megatron-core engine at 127\.0\.0\.1:\d+ \(refit ranks 2\.\.3, engine TP1 x DP2\)",
        trainer,
    ), trainer[-3000:]
    assert "built the trainer's GPTModel (2 layers, hidden 64, 4 heads / 2 query groups, padded vocabulary 128" in (
        engine
    ), engine[-3000:]
    # the versions the trainer refit, acknowledged by both engine ranks, are the ones the engine reports
    refits = re.findall(r"refit: version (\d+) \(p2p, [^)]*\); engine ranks hold \{2: (\d+), 3: (\d+)\}", trainer)
    assert refits == [(str(v),) * 3 for v in VERSIONS], trainer[-3000:]
    lines = re.findall(r"engine: applied version (\d+) in [\d.]+ ms; greedy tokens sha256:([0-9a-f]{16}) (.*)", engine)
    assert [int(v) for v, _, _ in lines] == VERSIONS, engine[-3000:]
    assert sorted(tokens, key=int) == [str(v) for v in VERSIONS]
    for v, digest, shown in lines:
        assert json.loads(shown) == tokens[v], (v, shown)
        assert digest == hashlib.sha256(json.dumps(tokens[v]).encode()).hexdigest()[:16], v
    assert "engine: the trainer closed the refit; the model holds version 6" in engine, engine[-3000:]
    assert "static requests" not in engine  # megatron-core's progress bar is kept out of the output
    # what a user checks: the engine generates what the trainer's weights generate
    start, start_margin = ref["start"]
    final, final_margin = ref["final"]
    assert ref["iteration"] == VERSIONS[-1]
    assert min(start_margin, final_margin) > 1e-3, (start_margin, final_margin)  # no near-ties: argmax is stable
    assert start != final  # training changed the tokens: the last version is not the first one again
    assert tokens["0"] == start, (tokens["0"], start)
    assert tokens[str(VERSIONS[-1])] == final, (tokens[str(VERSIONS[-1])], final)


def test_engine_with_another_tp_than_the_trainers_stops_both_jobs_within_seconds(tmp_path):
    """The trainer refits an engine of TP2 (--refit-engine-tp 2) but the engine starts at --tp 1 on its 2
    ranks: the engine says so, naming the flags, and every rank of both jobs stops long before the
    refit group's timeout (300 s)."""
    env = _env(str(tmp_path))
    store = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    trainer_flags = ["--refit-transport", "p2p", "--refit-store", store, "--refit-engine", "megatron",
                     "--refit-engine-tp", "2", "--refit-timeout-s", "300"]  # fmt: skip
    trainer = launch(1, *trainer_flags, env=env, log=str(tmp_path / "trainer.log"))
    engine = _engine(2, store, 1, "--tp", "1", "--timeout-s", "300", env=env, log=str(tmp_path / "engine.log"))
    try:
        for p in (trainer, engine):
            p.wait(timeout=120)
    finally:
        for p in (trainer, engine):
            if p.poll() is None:
                p.kill()
                p.wait()
    seconds = time.monotonic() - start
    out_t, out_e = _read(trainer), _read(engine)
    problem = (
        "--tp 1 on 2 process(es) runs TP1 x DP2, but the trainer refits an engine of TP2 x DP1 (its "
        "--refit-engine-tp / --refit-engine-dp): start the engine with --tp 2"
    )
    assert trainer.returncode != 0 and engine.returncode != 0, (out_t[-3000:], out_e[-3000:])
    for r in (1, 2):
        assert f"engine: error: RefitRejected: engine refit rank {r}: {problem}" in out_e, out_e[-3000:]
    assert "refit rank 0: refit ranks [1, 2] cannot take part in the refit, nothing was sent: engine refit rank 1: " \
        f"{problem}" in out_t, out_t[-3000:]  # fmt: skip
    assert seconds < 100, f"{seconds:.0f} s: the jobs waited for the refit group's timeout"


MOE_VERSIONS = (1, 2)


def _moe_trainer(port, n_engine, bucket_bytes):
    """One rank of a Python trainer job (the example script trains MoE at TP1 only): the tiny Qwen3-MoE at
    TP2 x EP2 (expert TP 1), refit to an engine of TP1 x DP2 x EP2 through megatron_trainer_refit(engine_ep=2);
    the greedy tokens of a plain loop over its forward at each version, computed before the refit sends it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.testing import tiny_llama
    from megatron_ext.weight_export.megatron_refit import megatron_trainer_refit

    spec = tiny_llama.TinyLlamaSpec(arch="qwen3_moe")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    model = tiny_llama.build_model(spec, tiny_llama.transformer_config(spec, tp=2, ep=2, init_method_std=0.1))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = wx.RefitGroup.join("127.0.0.1", port, rank, world + n_engine, backend="gloo", timeout_s=120)
    out = {}
    try:
        refit = megatron_trainer_refit(
            model, group, engine_tp=1, engine_dp=n_engine, engine_ep=2, bucket_bytes=bucket_bytes
        )
        for version in MOE_VERSIONS:
            if version > 1:  # the next version: the same noise on every rank's whole tensors
                gen = torch.Generator().manual_seed(version)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            out[version] = _greedy(model)
            refit.refit(version)
        out["acks"] = refit.engine_versions()
        refit.close()
    finally:
        group.close()
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """The engine command at --tp 1 --ep 2 (2 ranks) and a trainer job of 2 ranks (TP2 x EP2) at once."""
    from megatron_ext.weight_export import RefitConfig

    tmp = str(tmp_path_factory.mktemp("megatron_engine_moe"))
    env, port = _env(tmp), free_port()
    saved = os.path.join(tmp, "tokens.json")
    prompts = [",".join(map(str, p)) for p in PROMPTS]
    engine = _engine(2, f"127.0.0.1:{port}", 2, "--tp", "1", "--ep", "2", "--prompt-tokens", *prompts,
                     "--generate-tokens", str(NEW_TOKENS), "--save-tokens", saved, "--bucket-size-mb", BUCKET,
                     "--timeout-s", "120", env=env, log=os.path.join(tmp, "engine.log"))  # fmt: skip
    try:
        bucket = RefitConfig(transport="p2p", store=f"127.0.0.1:{port}", bucket_size_mb=float(BUCKET)).bucket_bytes
        trainer = run_on_ranks(
            _moe_trainer, 2, args=(port, 2, bucket), backend="gloo", timeout=240,
            env={k: env[k] for k in ("XDG_RUNTIME_DIR", "OMP_NUM_THREADS")},
        )  # fmt: skip
    except BaseException:
        engine.terminate()  # torchrun passes SIGTERM on to its workers (a SIGKILL would orphan them)
        try:
            engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()
        raise
    out = _finish_all({"the engine": engine}, timeout=120)["the engine"]
    with open(saved) as f:
        tokens = json.load(f)
    return {"trainer": trainer, "engine": out, "tokens": tokens}


def test_engine_command_serves_an_moe_trainer_at_another_ep_layout(moe_run):
    """Trainer TP2 x EP2 (expert TP 1) -> the engine command at --tp 1 --ep 2 (TP1 x DP2, 2 whole experts per
    engine rank): the engine builds the MoE GPTModel from the published config, and its greedy tokens after each
    version are the trainer model's (a plain greedy loop over its forward, no near-ties)."""
    trainer, engine, tokens = moe_run["trainer"], moe_run["engine"], moe_run["tokens"]
    assert "megatron-core engine TP1 x DP2 (experts: EP2 x expert TP1) on cpu" in engine, engine[-3000:]
    assert "padded vocabulary 128, float32, 4 experts top-2 over EP2); serving every version" in engine, engine[-3000:]
    assert trainer[0]["acks"] == {2: MOE_VERSIONS[-1], 3: MOE_VERSIONS[-1]}
    assert sorted(tokens, key=int) == [str(v) for v in MOE_VERSIONS], engine[-3000:]
    for v in MOE_VERSIONS:
        ref, margin = trainer[0][v]
        assert trainer[1][v][0] == ref  # both trainer ranks ran the same model
        assert margin > 1e-3, (v, margin)  # no near-ties: the argmax is stable under float32 reordering
        assert tokens[str(v)] == ref, (v, tokens[str(v)], ref)
    assert tokens["1"] != tokens["2"]  # the second version generates differently
    assert f"the trainer closed the refit; the model holds version {MOE_VERSIONS[-1]}" in engine, engine[-3000:]


def test_models_the_engine_cannot_build_are_refused_naming_the_field(run):
    """megatron_model_problem on the config the trainer publishes (megatron_model_config of the script's model):
    the engine builds it at TP 1 and 2, and refuses, naming the field, what it does not build."""
    published = run["ref"]["config"]
    assert published["format"] == 3 and published["model"] == "GPTModel"
    config = published["config"]
    assert (config["num_query_groups"], config["padded_vocab_size"], config["activation_func"]) == (2, 128, "silu")
    assert json.loads(json.dumps(published)) == published  # plain JSON, nothing pickled
    assert megatron_model_problem(published, 1) is None and megatron_model_problem(published, 2) is None

    def problem(tp=1, fmt=None, ep=1, **fields):
        changed = {**published, "config": {**config, **fields}}
        if fmt is not None:
            changed["format"] = fmt
        return megatron_model_problem(changed, tp, ep)

    assert problem(fmt=4) == (
        "the trainer publishes its model config in format 4; this engine reads format 3: run the same megatron_ext "
        "release in the engine as in the trainer"
    )
    # format 1 (an older trainer: dense, no MoE fields) is still read
    old = {k: v for k, v in config.items() if k in MODEL_FIELDS or k in ("multi_latent_attention", "window_size")}
    assert megatron_model_problem({**published, "format": 1, "config": old}, 1) is None
    # MoE: what the engine builds (SequentialMLP experts of the local spec, softmax top-k) and what it refuses
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=32)
    assert config["moe_token_dispatcher_type"] == "allgather" and config["moe_grouped_gemm"] is False
    assert problem(**moe) is None and problem(tp=2, **moe) is None and problem(tp=2, ep=2, **moe) is None
    # format 2 (an MoE trainer before moe_layer_freq: every layer an MoE layer) is still read
    two = {k: v for k, v in {**config, **moe}.items() if k != "moe_layer_freq"}
    assert megatron_model_problem({**published, "format": 2, "config": two}, 1) is None
    # format 3: dense (0) and MoE (1) layers, one entry per layer; a dense layer's MLP splits over the engine's TP
    layers = config["num_layers"]
    assert problem(**moe, moe_layer_freq=[0] + [1] * (layers - 1)) is None
    assert problem(tp=2, **moe, ffn_hidden_size=33) is None  # every layer an MoE layer: no dense MLP to split
    assert problem(tp=2, **moe, ffn_hidden_size=33, moe_layer_freq=[0] + [1] * (layers - 1)) == (
        "ffn_hidden_size=33 is not divisible by the engine's TP 2: pick a TP that divides it"
    )
    assert problem(**moe, moe_layer_freq=[1] * (layers + 1)) == (
        f"moe_layer_freq has {layers + 1} entries: the engine builds moe_layer_freq = a list of num_layers={layers} "
        "entries, each 0 (dense MLP) or 1 (MoE)"
    )
    kind = "null (every layer an MoE layer) or a list of num_layers entries, each 0 (dense MLP) or 1 (MoE)"
    for bad in (2, [2] * layers, [True] * layers):  # Megatron's int form is published as its pattern
        assert problem(**moe, moe_layer_freq=bad) == (
            f"moe_layer_freq={bad!r}: the engine builds moe_layer_freq = {kind}"
        ), bad
    assert problem(moe_token_dispatcher_type="flex") is None  # a dense model: the MoE fields are not read
    assert problem(**moe, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_router_dtype="fp32") is None
    assert problem(**moe, moe_grouped_gemm=True) == (
        "moe_grouped_gemm=True: the engine builds moe_grouped_gemm = one of [False] (megatron-core's local layer "
        "spec runs SequentialMLP experts; grouped GEMM experts (TEGroupedMLP) need Transformer Engine)"
    )
    assert problem(**moe, moe_token_dispatcher_type="flex") == (
        "moe_token_dispatcher_type='flex': the engine builds moe_token_dispatcher_type = one of ['allgather', "
        "'alltoall'] (the flex dispatcher needs DeepEP / HybridEP)"
    )
    assert problem(**moe, moe_router_score_function="sigmoid").startswith(
        "moe_router_score_function='sigmoid': the engine builds moe_router_score_function = one of ['softmax']"
    )
    assert problem(**moe, moe_router_load_balancing_type="sinkhorn").startswith(
        "moe_router_load_balancing_type='sinkhorn': the engine builds moe_router_load_balancing_type = one of "
        "['aux_loss', 'seq_aux_loss', 'global_aux_loss', 'none'] or a list of them (sinkhorn and quantile"
    )
    assert problem(**moe, moe_shared_expert_intermediate_size=64) == (
        "moe_shared_expert_intermediate_size=64: the engine builds GPT models of megatron-core's local layer spec "
        "without it (moe_shared_expert_intermediate_size=None)"
    )
    assert problem(**moe, moe_router_enable_expert_bias=True) == (
        "moe_router_enable_expert_bias=True: the engine builds GPT models of megatron-core's local layer spec "
        "without it (moe_router_enable_expert_bias=False; the router's expert_bias is a buffer: the refit sends "
        "parameters)"
    )
    assert problem(**moe, moe_expert_capacity_factor=1.0).startswith("moe_expert_capacity_factor=1.0: the engine")
    assert problem(num_moe_experts=4, moe_ffn_hidden_size=None) == (
        "moe_ffn_hidden_size=None: the engine builds moe_ffn_hidden_size = an integer >= 1"
    )
    assert (
        problem(num_moe_experts=0) == "num_moe_experts=0: the engine builds num_moe_experts = null or an integer >= 1"
    )
    assert problem(ep=8, **moe) == (
        "num_moe_experts=4 is not divisible by the engine's EP 8: pick an EP that divides it"
    )
    assert problem(**moe, moe_router_topk=5) == "moe_router_topk=5 exceeds num_moe_experts=4"
    assert problem(tp=2, num_moe_experts=4, moe_ffn_hidden_size=33) == (
        "moe_ffn_hidden_size=33 is not divisible by the engine's expert TP 2 (its TP at EP 1): pick a TP that "
        "divides it, or EP > 1 (whole experts)"
    )
    assert problem(tp=2, ep=2, num_moe_experts=4, moe_ffn_hidden_size=33) is None  # EP2: whole experts
    assert problem(transformer_impl="transformer_engine") == (
        "transformer_impl='transformer_engine': the engine builds transformer_impl = one of ['local']"
    )
    assert problem(activation_func="my_model.swish").startswith(
        "activation_func='my_model.swish': the engine builds activation_func = one of ['silu', 'gelu', 'relu'"
    )
    assert problem(normalization="Norm") == (
        "normalization='Norm': the engine builds normalization = one of ['LayerNorm', 'RMSNorm']"
    )
    assert problem(num_layers=0) == "num_layers=0: the engine builds num_layers = an integer >= 1"
    assert problem(tp=4) == "num_query_groups=2 is not divisible by the engine's TP 4: pick a TP that divides it"
    assert "fields this engine does not know (sliding_chunks)" in problem(sliding_chunks=2)
    error = {"format": 1, "error": "ValueError: the refit group has 5 ranks"}
    assert megatron_model_problem(error, 1) == (
        "the trainer could not build its side of the refit: ValueError: the refit group has 5 ranks"
    )


def _published_model_body(backend):
    """One rank: the tiny Llama as a trainer holds it (float32, and bfloat16 inside Float16Module as
    Megatron-LM trains it), the engine's model built from megatron_model_config of it, the trainer's
    weights copied in by name; the engine's tokens and logits against the trainer model's forward."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.sharding.names import unwrap
    from megatron_ext.testing import cpu_compat, tiny_llama
    from megatron_ext.weight_export import megatron_logits, verify_export
    from megatron_ext.weight_export.engines.megatron import MegatronEngine
    from megatron_ext.weight_export.engines.megatron_config import (
        build_engine_model,
        megatron_model_config,
        megatron_model_problem,
    )

    cpu_compat.install_inference()  # CPU only (no-op with CUDA)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    tokens = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    trainers = {}
    # dense and MoE layers mixed: moe_layer_freq 2 makes layers 0 and 2 MoE layers, 1 and 3 dense MLPs
    mixed = tiny_llama.TinyLlamaSpec(arch="qwen3_moe", num_layers=4, moe_layer_freq=2)
    for arch, dtype in (
        ("llama", torch.float32),
        ("llama", torch.bfloat16),
        ("qwen3_moe", torch.float32),
        ("qwen3_moe_mixed", torch.float32),
    ):
        # plain forwards first: the engine switches on inference mode
        half = dtype != torch.float32
        spec = mixed if arch == "qwen3_moe_mixed" else tiny_llama.TinyLlamaSpec(arch=arch)
        cfg = tiny_llama.transformer_config(
            spec, init_method_std=0.1, params_dtype=dtype, pipeline_dtype=dtype, bf16=half
        )
        model = tiny_llama.build_model(spec, cfg, device=device)
        model = Float16Module(cfg, model) if half else model
        trainers[arch, dtype] = (model, megatron_logits(model, tokens), _greedy(model)[0])
    out = {}
    for key, (trainer, logits, greedy) in trainers.items():
        published = megatron_model_config(trainer)
        assert megatron_model_problem(published, 1) is None, megatron_model_problem(published, 1)
        model = build_engine_model(published, device=device)
        mine, theirs = dict(unwrap(model).named_parameters()), dict(unwrap(trainer).named_parameters())
        kind = lambda t: (t.shape, t.dtype, t.device)  # noqa: E731
        out[key] = {
            "names": sorted(mine) == sorted(theirs),
            "experts": sum(".local_experts." in n for n in mine),
            "dense_mlps": sum(n.endswith(".mlp.linear_fc1.weight") for n in mine),
            "moe_layer_freq": published["config"]["moe_layer_freq"],
            "nan": all(p.isnan().all() for p in mine.values()),  # nothing but a refit writes the weights
            "wrapper": type(model).__name__,
            "other": [n for n, p in mine.items() if kind(p) != kind(theirs[n])],
        }
        with torch.no_grad():
            for n, p in mine.items():
                p.copy_(theirs[n])
        engine = MegatronEngine(model, max_batch_size=len(PROMPTS), max_sequence_length=16)
        out[key].update(
            tokens=engine.generate(PROMPTS, NEW_TOKENS),
            greedy=greedy,
            gate=verify_export(logits, engine.logits(tokens)),
        )
    return out


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(1))])
def test_engine_model_built_from_the_published_config_is_the_trainers(backend, monkeypatch):
    """build_engine_model(megatron_model_config(trainer)) has the trainer's parameters (names, shapes, dtypes),
    NaN until written; with the trainer's weights, its greedy tokens and logits are the trainer model's, in
    float32 and in bfloat16 (Float16Module, as Megatron-LM trains and serves it), and for the tiny Qwen3-MoE
    (SequentialMLP experts, its router and expert weights included), all-MoE and with dense layers between
    (moe_layer_freq 2: published as its per-layer pattern, built as megatron-core builds it)."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = run_on_ranks(_published_model_body, 1, args=(backend,), backend=backend, timeout=180)[0]
    assert set(out) == {
        ("llama", torch.bfloat16),
        ("llama", torch.float32),
        ("qwen3_moe", torch.float32),
        ("qwen3_moe_mixed", torch.float32),
    }
    moe, mixed = out["qwen3_moe", torch.float32], out["qwen3_moe_mixed", torch.float32]
    assert moe["experts"] == 2 * 4 * 2  # layers x experts x (fc1, fc2): all built
    assert (moe["moe_layer_freq"], moe["dense_mlps"]) == ([1, 1], 0)
    assert mixed["experts"] == 2 * 4 * 2 and mixed["dense_mlps"] == 2  # MoE layers 0, 2; dense MLPs 1, 3
    assert mixed["moe_layer_freq"] == [1, 0, 1, 0]
    for (_, dtype), got in out.items():
        assert got["names"] and not got["other"] and got["nan"], (dtype, got)
        assert got["wrapper"] == ("GPTModel" if dtype == torch.float32 else "Float16Module"), (dtype, got["wrapper"])
        assert got["gate"].ok(max_kl=1e-3) and got["gate"].max_abs_diff < 1e-2, (dtype, got["gate"])
        if dtype == torch.float32:  # bf16 decoding with a KV cache may round other ways than the full forward
            assert got["tokens"] == got["greedy"], (got["tokens"], got["greedy"])


S = "127.0.0.1:29700"
MEGATRON = ["--engine", "megatron", "--refit-store", S]


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--engine", "vllm", "--refit-store", S], 1, "argument --engine: invalid choice: 'vllm'"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--model", "m"], 1,
         "--model goes with --engine hf, not --engine megatron"),
        (["--engine", "megatron", "--address", S], 1, "--address goes with --engine hf, not --engine megatron"),
        (MEGATRON, 1, "--engine megatron needs --refit-rank-offset T >= 1, the trainer's number of ranks"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--tp", "4"], 2,
         "--tp 4 must be >= 1 and divide the engine job's 2 process(es)"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--ep", "3"], 2,
         "--ep 3 must be >= 1 and divide the engine job's 2 process(es)"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--ep", "0"], 2,
         "--ep 0 must be >= 1 and divide the engine job's 2 process(es)"),
        (["--model", "m", "--refit-store", S, "--refit-rank", "1", "--refit-world-size", "2", "--ep", "2"], 1,
         "--ep goes with --engine megatron, not --engine hf"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--refit-world-size", "5"], 2,
         "--refit-world-size 5 is not --refit-rank-offset 2 + the engine job's 2 process(es) = 4"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--prompt-tokens", "3,x"], 1,
         "--prompt-tokens (comma-separated token ids per prompt, e.g. 3,17,5) must hold a non-empty list of prompts"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--generate-tokens", "4"], 1,
         "--generate-tokens / --save-tokens go with --prompts FILE or --prompt-tokens"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--prompt-tokens", "1", "--generate-tokens", "0"], 1,
         "--generate-tokens must be >= 1, got 0"),
        ([*MEGATRON, "--refit-rank-offset", "2", "--device", "cuda:1"], 1, "--device must be cuda (each rank on its"),
        (["--model", "m", "--refit-store", S, "--refit-rank", "1", "--refit-world-size", "2", "--tp", "2"], 1,
         "--tp goes with --engine megatron, not --engine hf"),
    ],
)  # fmt: skip
def test_bad_engine_flags_are_refused_at_parse_time(argv, world, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_info:
        engine_command._args(argv, megatron_on_cpu=True)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_ep_other_than_the_trainers_is_refused_naming_the_flag(monkeypatch):
    """--ep is checked against the engine layout the trainer publishes (megatron_trainer_refit(engine_ep=)):
    the command refuses the refit, naming the flag, as it does --tp (that path runs end to end above)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = engine_command._args([*MEGATRON, "--refit-rank-offset", "2", "--ep", "2"], megatron_on_cpu=True)
    assert (args.tp, args.ep) == (1, 2)
    config = {"padded_vocab_size": 128, "max_sequence_length": 64}
    published = {"config": config, "engine": {"tp": 1, "dp": 2, "ep": 1, "etp": 1}}
    assert engine_command._engine_problem(args, published) == (
        "--ep 2: the trainer refits an engine of EP1 (megatron_trainer_refit(engine_ep=1)): start the engine with "
        "--ep 1"
    )
    assert engine_command._engine_problem(args, {**published, "engine": {"tp": 1, "dp": 2, "ep": 2}}) is None
    assert "--ep 2" in engine_command._engine_problem(args, {**published, "engine": {"tp": 1, "dp": 2}})  # format 1


def test_megatron_engine_command_refuses_cpu_outside_the_test_entry_point(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        engine_command._args([*MEGATRON, "--refit-rank-offset", "1"])
    assert "--engine megatron runs on CUDA GPUs" in capsys.readouterr().err


P2P = ["--refit-transport", "p2p", "--refit-store", S]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--refit-engine", "megatron"], "--refit-engine megatron refits megatron-core's engine over the p2p refit"),
        (["--refit-engine", "sglang", *P2P], "argument --refit-engine: invalid choice: 'sglang'"),
        ([*P2P, "--refit-engine", "megatron", "--refit-quantize", "fp8-block"],
         "--refit-quantize: not read with --refit-engine megatron"),
        ([*P2P, "--refit-engine", "megatron", "--refit-engine-tp", "3"],
         "--num-attention-heads 4 must be divisible by --refit-engine-tp 3 (the engine's TP)"),
    ],
)  # fmt: skip
def test_bad_trainer_flags_for_the_megatron_engine_are_refused_at_parse_time(flags, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        _script().parse_args([*MODEL, *TRAIN, *flags], world_size=2, cuda=False)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
