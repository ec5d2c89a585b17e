"""examples/pretrain_gpt.py launched the way Megatron users launch training:
``python -m torch.distributed.run --standalone --nproc-per-node N examples/pretrain_gpt.py ...``,
each capability switched on by flags only, the weight-export engine started by its own
command (``python -m megatron_ext.weight_export.engine``).

On CPU (gloo) four launches, each checked for several things:

- side by side: A = uniform TP2 x DP1 with Megatron's own DDP (``--symm-mem off``) and
  distributed optimizer, exporting its starting weights and then every 2 iterations to a
  separately started engine, saving at iteration 3;
  B = NTP ``--ntp-tp-base 2 --ntp-failed-slots 0:1`` on the 3 healthy ranks (replica 0 at TP1,
  the satellite of replica 1 at TP2) with ``--sequence-parallel`` (on replica 1; TP1 runs without),
  ``--symm-mem on``, Megatron's plain optimizer and small transfer units (``--ntp-transfer-chunk-mb
  0.05``: several per bucket), saving at iteration 3;
- then C = NTP with the distributed optimizer and measured batch shares (``--ntp-balance measured
  --ntp-balance-measure-steps 1``: by TP degree, 1 and 3 of the 4 micro-batches, for its first
  iteration, then by the replicas' measured throughputs) resuming A's uniform checkpoint
  (once A is done) and D = uniform TP2 x DP1
  (``--symm-mem`` at its default, auto) resuming B's NTP checkpoint (once B is done).

Every launch prints SHA-256 digests of the model and the optimizer state after each save and
load (``--log-checkpoint-digest``): an NTP job's checkpoint is its healthy replicas' uniform
``tp_base`` one, so a uniform TP2 job loads B's (plain optimizer) and an NTP job loads A's
(distributed optimizer) bit for bit, model and optimizer state alike.

A fifth launch, on its own: E = an MoE model (4 experts of ffn 32, top-2, aux loss 1e-2) at TP1 x DP4 x
EP2 (2 local experts per rank, expert data-parallel size 2) with Megatron's DDP, refitting
megatron-core's inference engine (started on its own at --tp 1 --ep 2, 2 ranks) at start, every 3
iterations and at the end, and saving its last iteration; then R, one rank in this process's
``run_on_ranks``: the same flags at EP1 (all 4 experts on one rank, 4 micro-batches) trained by the
script's own ``main``, and greedy tokens of the starting model and of E's checkpoint loaded at EP1.

Loss tolerance. Every layout trains the same global model (CPU initialisation from the
seed) on the same global batches in fp32; they differ only in the order of floating-point
reductions (TP partial sums, the gradient all-reduce, a degraded replica's gradients resharded
and added into its partner's buckets). That agrees with a single-rank run within 1e-5 relative
per step over 10 steps (tests/unit_tests/nonuniform_tp/test_ntp_training.py, RTOL); the script
prints the loss with 7 significant digits (``%.6E``), up to 5e-7 relative off per value. So two
layouts must agree within RTOL = 1e-5 + 2 x 5e-7 (sequence parallelism, in B and not in A, D, is one
more reordering: B's losses print equal to A's). Faults are far outside it: B with the degraded
replica's gradients left out of its partner's buckets put the second loss 9e-3 off; B with the norms'
parameters not marked ``sequence_parallel`` (their gradients then not summed over TP) 1.7e-5 relative
(the third 2.4e-5, the fourth 3.8e-5); resuming with
a wrong Adam step count put the next loss 5e-3 off here, resuming without the optimizer state 0.6
off.

MoE (E vs R) holds to the same RTOL: the script draws the same global model at every EP degree
(each expert from its global index, the RNG stream as at EP1), the batches are the same, and
what differs is again the order of reductions (an expert's output and its gradients reach a token
through the dispatcher's all-gather / reduce-scatter over the EP group instead of locally, expert
gradients are summed over the expert data-parallel group instead of the data-parallel one). Two
things could make MoE layouts differ by more, and neither does here: routing is per token (top-k of
its own router logits; with these weights no near-tie flips under fp32 reordering, or the losses
would jump by far more than RTOL) and dropless (the script offers no capacity factor, which would
drop tokens per EP rank); and ``--moe-router-load-balancing-type aux_loss`` takes each micro-batch's
own tokens (its reduce group is TP x CP = 1 rank), and E's micro-batches are R's, scaled alike
(1 micro-batch per rank averaged over DP4 = 4 micro-batches / 4). ``global_aux_loss`` would not do:
it pools the tokens of the DP ranks' concurrent micro-batches, which R does not have. The logged
``load_balancing_loss`` (the aux loss itself) is held to the same RTOL. A fault is far outside it:
drawing the experts per EP rank (megatron-core's SequentialMLP on CPU) puts E's first loss 0.1 off.

Pipeline parallelism (``pp_runs``): L = TP2 x PP2 interleaved (2 model chunks per rank) with
``--sequence-parallel``, the distributed optimizer and ``--overlap-grad-reduce``, and M = TP1 x PP2 (plain
1F1B), both against R0 = the same 4-layer model with tied embeddings at PP1 on one rank; then R1 = PP1 resuming
M's iteration-3 checkpoint. The same RTOL holds, for the same reason: the script draws the same global model at
every PP degree (each model chunk draws and drops what a PP1 job draws before its layers), a stage boundary passes
activations and their gradients unchanged, and each stage accumulates its micro-batches' gradients in the order
one stage does. What is reordered: the tied embedding's gradient (at PP1 one buffer takes the output layer's and
the embedding's contributions micro-batch by micro-batch; at PP2 each of its two stages sums its own over the 4
micro-batches and finalize_model_grads adds the two sums: 8 fp32 terms in another order, at most ~8 x 2^-24 =
5e-7 relative per element), the grad norm (squares summed per stage, then over the stages; through clipping the
same ulp-level factor on every gradient) and, in L, the TP partial sums of the layouts above. Two values are exact,
with no reduction reordered before them: M's first loss is R0's (the same weights, the same forward) and R1's
first loss is M's at iteration 4 (the weights M saved, equal digests). Faults are far outside RTOL: the embedding
gradients not summed over the two stages put L's second loss 2.5e-2 off (5e-3 relative) and R1's first loss 0.13
off M's (the checkpoint holds the first stage's copy); the chunks after the first drawing their layers without first
drawing the embedding put L's first loss 9.3e-4 off; the last stage scoring another sample's labels 5.9e-4 off.
"""

import os
import re
import subprocess
import sys

import pytest

from megatron_ext.testing.multirank import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
RTOL = 1e-5 + 2 * 5e-7
ITERS = 6
VOCAB = 120  # the HF vocabulary; Megatron pads it to 128 at every layout used here
# A tiny Llama-shaped model (the export maps it to transformers' LlamaForCausalLM).
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "96",
    "--seq-length",
    "16",
    "--vocab-size",
    str(VOCAB),
    "--make-vocab-size-divisible-by",
    "64",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
# The pipeline runs' model: 4 layers (1 per model chunk at PP2 with 2 chunks per rank) and the word embedding
# tied to the output layer (at PP > 1 the first and the last stage each hold a copy; finalize_model_grads sums
# their gradients)
PP_MODEL = [f for f in MODEL if f != "--untie-embeddings-and-output-weights"] + ["--num-layers", "4"]
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
# nonuniform TP with pipeline stages: replica 0 lost slot 1 of stage 1, so it runs both stages at TP 1
NTP_PP = ["--ntp-tp-base", "2", "--ntp-failed-slots", "0,1:1", "--ntp-policy", "degrade"]
TRAIN = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    str(ITERS),
    "--lr",
    "3e-3",
    "--log-interval",
    "1",
    "--seed",
    "1234",
]
NTP = ["--ntp-tp-base", "2", "--ntp-failed-slots", "0:1", "--ntp-policy", "degrade"]
# --ntp-policy auto (the default) with equal shares: the degraded replica would be every step's straggler
# (2 micro-batches at TP1 take as long as the healthy replica's 4), so the cost model drops it
NTP_AUTO = ["--ntp-tp-base", "2", "--ntp-failed-slots", "0:1"]
# replica 1 degraded: the last rank, which prints the log lines, is a degraded one
NTP_LAST = ["--ntp-tp-base", "2", "--ntp-failed-slots", "1:1", "--ntp-policy", "degrade"]
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| grad norm: ([0-9.]+) \|")
DIGEST = ["--log-checkpoint-digest"]
P2P_MEGATRON = ["--refit-transport", "p2p", "--refit-store", "127.0.0.1:1", "--refit-engine", "megatron"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
DIGESTS = re.compile(
    r"^(saved|loaded) checkpoint (?:at|from) .*?iteration\s+(\d+) .*; digests: model ([0-9a-f]{16}), "
    r"optimizer ([0-9a-f]{16})$",
    re.M,
)


def _env(tmp) -> dict:
    keys = os.path.join(tmp, "run")  # the engine's loopback key lives here (both sides read it)
    os.makedirs(keys, mode=0o700, exist_ok=True)
    return {**os.environ, "XDG_RUNTIME_DIR": keys, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _start(cmd: list[str], env: dict, log: str) -> subprocess.Popen:
    """Start ``cmd`` with its output in the file ``log`` (a pipe nobody reads yet could fill and block it)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def launch(nproc: int, *flags: str, env: dict, log: str, model: list[str] = MODEL) -> subprocess.Popen:
    """``python -m torch.distributed.run --standalone --nproc-per-node N examples/pretrain_gpt.py FLAGS``."""
    return _start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            SCRIPT,
            *model,
            *TRAIN,
            *flags,
        ],
        env,
        log,
    )


def engine_command(
    model_dir: str | None, address: str, device: str, env: dict, log: str, *p2p: str
) -> subprocess.Popen:
    """The engine on its own: ``python -m megatron_ext.weight_export.engine [--model DIR] --address HOST:PORT``
    (no ``model_dir``: the engine builds its model from the config the trainer sends), or with ``p2p`` flags
    (``--refit-rank R --refit-world-size W``) one p2p engine rank at the store ``address``."""
    where = ["--refit-store", address, *p2p] if p2p else ["--address", address, "--sessions", "1"]
    model = [] if model_dir is None else ["--model", model_dir]
    cmd = [sys.executable, "-m", "megatron_ext.weight_export.engine", *model, *where]
    return _start([*cmd, "--device", device, "--timeout-s", "240"], env, log)


def finish(proc: subprocess.Popen, what: str, timeout: float = 300) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        with open(proc.log) as f:
            raise AssertionError(f"{what} did not finish in {timeout}s:\n{f.read()[-6000:]}") from None
    with open(proc.log) as f:
        out = f.read()
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{out[-6000:]}"
    return out


def losses(out: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(out)}


def digests(out: str) -> dict[tuple[str, int], tuple[str, str]]:
    """``{("saved" | "loaded", iteration): (model digest, optimizer digest)}`` (--log-checkpoint-digest)."""
    return {(kind, int(it)): (model, opt) for kind, it, model, opt in DIGESTS.findall(out)}


def assert_same_losses(got: dict, want: dict, iterations, what: str) -> None:
    for it in iterations:
        assert it in got and it in want, f"{what}: iteration {it} missing: {got} vs {want}"
        assert abs(got[it] - want[it]) <= RTOL * abs(want[it]), f"{what}, iteration {it}: {got[it]} vs {want[it]}"


def hf_model_dir(path: str) -> str:
    """A Hugging Face Llama with the script's model shape (random weights): the engine's model."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four launches and the engine; their outputs. A and B (and the engine) start together;
    C starts when A is done, D when B is."""
    tmp = str(tmp_path_factory.mktemp("pretrain"))
    env = _env(tmp)
    ck_uniform, ck_ntp = os.path.join(tmp, "ckpt_uniform"), os.path.join(tmp, "ckpt_ntp")
    # A and B cache the dataset index each in its own folder (rank 0 builds it, the other ranks
    # read it); C and D read those caches.
    cache_a, cache_b = os.path.join(tmp, "cache_a"), os.path.join(tmp, "cache_b")
    log = lambda name: os.path.join(tmp, f"{name}.log")  # noqa: E731
    b = launch(
        3,
        *NTP,
        *DIGEST,
        "--sequence-parallel",
        "--ntp-transfer-chunk-mb",
        "0.05",
        "--symm-mem",
        "on",
        "--save",
        ck_ntp,
        "--save-interval",
        "3",
        "--data-cache-path",
        cache_b,
        env=env,
        log=log("B"),
    )
    port = free_port()
    address = f"127.0.0.1:{port}"
    # The engines as the docs start them on a fresh clone: no --model, the HF model built from the trainer's config.
    engine = engine_command(None, address, "cpu", env, log("engine"))
    # D's p2p engine: refit rank 2 of 3 (D's two ranks first), at the store D's rank 0 hosts.
    store = f"127.0.0.1:{free_port()}"
    engine_p2p = engine_command(
        None, store, "cpu", env, log("engine_p2p"), "--refit-rank", "2", "--refit-world-size", "3"
    )
    procs = [engine, engine_p2p, b]
    out = {}

    def resume_from(ck: str) -> None:
        # Resume from iteration 3 of the other layout (the job also saved its last iteration).
        with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")

    try:
        a = launch(
            2,
            *DIGEST,
            "--tensor-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--symm-mem",
            "off",
            "--save",
            ck_uniform,
            "--save-interval",
            "3",
            "--data-cache-path",
            cache_a,
            "--weight-export-target",
            address,
            "--weight-export-transport",
            "broadcast",
            "--weight-export-every-n-steps",
            "2",
            env=env,
            log=log("A"),
        )
        procs.append(a)
        # Each resume starts as soon as the checkpoint it reads is complete.
        out["A"] = finish(a, "A (uniform, export)")
        resume_from(ck_uniform)
        c = launch(
            3,
            *NTP_LAST,
            *DIGEST,
            "--use-distributed-optimizer",
            "--ntp-balance",
            "measured",
            "--ntp-balance-measure-steps",
            "1",
            "--load",
            ck_uniform,
            "--data-cache-path",
            cache_a,
            env=env,
            log=log("C"),
        )
        procs.append(c)
        out["B"] = finish(b, "B (NTP, symm-mem on)")
        resume_from(ck_ntp)
        d = launch(
            2,
            *DIGEST,
            "--tensor-model-parallel-size",
            "2",
            "--load",
            ck_ntp,
            "--data-cache-path",
            cache_b,
            "--reshard-refit-store",  # the alias selects --refit-transport p2p
            store,
            "--refit-every-n-steps",
            "2",
            env=env,
            log=log("D"),
        )
        procs.append(d)
        e = launch(3, *NTP_AUTO, "--data-cache-path", cache_a, env=env, log=log("E"))
        procs.append(e)
        out["engine"] = finish(engine, "the engine", timeout=60)
        out["C"] = finish(c, "C (NTP resuming the uniform checkpoint)")
        out["D"] = finish(d, "D (uniform TP2 resuming the NTP checkpoint)")
        out["E"] = finish(e, "E (NTP flags, --ntp-policy auto: drops the degraded replica)")
        out["engine_p2p"] = finish(engine_p2p, "the p2p engine", timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_auto_policy_drops_a_straggler_replica_and_trains_like_uniform_tp(runs):
    """E: A's flags plus --ntp-tp-base 2 --ntp-failed-slots 0:1 on 3 ranks and equal shares; --ntp-policy auto
    predicts dropping replica 0 faster (one INFO line with both predictions), its process leaves, and the healthy
    replica trains as A does (uniform TP2)."""
    a, e = losses(runs["A"]), losses(runs["E"])
    assert "--ntp-policy auto" in runs["E"] and re.search(r"drop [0-9.]+%.*: drop$", runs["E"], re.M), runs["E"][-3000:]
    assert "rank 0: its replica is dropped (--ntp-policy); leaving" in runs["E"]
    assert (
        "nonuniform TP: replica(s) [0] dropped (--ntp-policy), the healthy replicas train as a uniform job: "
        "TP=2 x DP=1, TP groups [[0, 1]]"
    ) in runs["E"]
    assert "DDP wrapper NonuniformTPDistributedDataParallel" in runs["E"]
    assert_same_losses(e, a, range(1, ITERS + 1), "dropped vs uniform")


def test_ntp_with_a_failed_slot_trains_like_uniform_tp(runs):
    """B (NTP: replica 0 at TP1 after losing slot 1, the satellite of replica 1 at TP2, sequence parallelism on
    replica 1) vs A (uniform TP2, no sequence parallelism)."""
    a, b = losses(runs["A"]), losses(runs["B"])
    assert sorted(a) == list(range(1, ITERS + 1)), runs["A"][-3000:]
    assert a[ITERS] < a[1] - 0.3, f"the baseline did not learn: {a}"
    assert_same_losses(b, a, range(1, ITERS + 1), "NTP vs uniform")
    assert (
        "nonuniform TP: on, tp_base=2, replica(s) [0] at TP=1, TP groups [[0], [1, 2]], launch packed, degraded -> "
        "partner replica 0 -> 1 (transfers in units of <= 0.05 MiB)"
    ) in runs["B"]
    assert "DDP wrapper NonuniformTPDistributedDataParallel, sequence parallel (at TP > 1)" in runs["B"]
    assert "nonuniform TP: off" in runs["A"] and "DDP wrapper DistributedDataParallel" in runs["A"]
    assert "sequence parallel" not in runs["A"]
    line = next(ln for ln in runs["B"].splitlines() if re.search(r"iteration\s+6/", ln))
    assert "throughput (tokens/s):" in line and "elapsed time per iteration (ms):" in line, line


def test_symmetric_memory_flags_fall_back_on_gloo_and_train(runs):
    """--symm-mem on (B, NTP buckets) and the default auto (D, SymmMemDistributedDataParallel): on gloo every
    bucket stays plain, the start-up summary says so and why, and training matches plain Megatron DDP (A)."""
    assert re.search(
        r"symmetric memory: mode=on, 0 of [1-9]\d* bucket buffers symmetric over all ranks \(fallback "
        r"to plain buffers\); plain because: unavailable: process-group backend is 'gloo'",
        runs["B"],
    ), runs["B"][-3000:]
    assert re.search(
        r"symmetric memory: mode=auto, 0 of [1-9]\d* bucket buffers symmetric over all ranks \(fallback", runs["D"]
    ), runs["D"][-3000:]
    assert "DDP wrapper SymmMemDistributedDataParallel" in runs["D"]
    assert "NCCL symmetric memory is unavailable" in runs["B"]  # the one-time warning
    assert "symmetric memory: off (Megatron's DDP buffers)" in runs["A"]
    assert_same_losses(losses(runs["D"]), losses(runs["A"]), range(4, ITERS + 1), "symm-mem auto vs plain DDP")


def test_weight_export_to_an_engine_started_on_its_own(runs):
    """A exports its starting weights and then every 2 iterations over the broadcast transport (gloo) to
    ``python -m megatron_ext.weight_export.engine`` (no --model: it builds the HF model from the config A sends);
    the engine applies each version atomically."""
    engine, a = runs["engine"], runs["A"]
    assert "engine: serving the trainer's model (built from its config at its first plan)" in engine, engine
    assert re.search(
        r"weight export: broadcast to 127\.0\.0\.1:\d+ at start, every 2 iterations and at the end; "
        r"\d+ HF tensors",
        a,
    ), a[-3000:]
    for version in (0, 2, 4, 6):
        assert f"engine: applied version {version}\n" in engine, engine
        assert f"weight export: version {version} (" in a and f"engine applied [{version}]" in a, a[-3000:]
    assert engine.count("engine: applied version") == 4, engine  # the end (6) is not sent twice
    assert "session 1 ended; the model holds version 6" in engine, engine


def test_checkpoints_resume_across_layouts(runs):
    """C: an NTP job (replica 1 degraded) resumes the uniform job's iteration-3 checkpoint, its
    replicas taking unequal shares of each global batch (--ntp-balance measured: by TP degree for
    iteration 4, then by the throughputs measured in it, whatever they are on this machine); D: a
    uniform TP2 job resumes the NTP job's. Both go on exactly as the uninterrupted runs did (model,
    optimizer state, learning-rate schedule and data position restored; the shares change who
    computes which sample, not the global batch)."""
    a, b, c, d = (losses(runs[k]) for k in "ABCD")
    assert sorted(c) == sorted(d) == [4, 5, 6], (c, d)
    assert_same_losses(c, a, range(4, ITERS + 1), "NTP resumed from uniform")
    assert_same_losses(d, b, range(4, ITERS + 1), "uniform TP2 resumed from NTP")
    assert "saved as uniform TP=2 x DP=1; resumed as NTP tp_base=2" in runs["C"]
    assert (
        "--ntp-balance measured: batch shares: [3, 1] micro-batches of 2 per replica (global batch 8) for "
        "throughputs [2, 1]; predicted step at 88.9% of the balanced ideal until 1 iteration(s) are timed"
    ) in runs["C"]
    # C's log lines come from its last rank, a degraded replica's, whose optimizer owns nothing: the grad norm
    # it prints is the healthy replicas' (0.000 before the script took it from the first healthy rank)
    norms = {k: {int(i): float(v) for i, v in GRAD_NORM.findall(runs[k])} for k in "AC"}
    assert sorted(norms["C"]) == [4, 5, 6], runs["C"][-3000:]
    for it, got in norms["C"].items():  # printed with 3 decimals
        assert got > 0 and abs(got - norms["A"][it]) <= 1e-3 + RTOL * norms["A"][it], (it, norms)
    assert re.search(
        r"--ntp-balance measured after iteration 4: median compute ms per replica \[\d+\.\d, \d+\.\d\]; "
        r"(now|kept) batch shares: \[[1-3], [1-3]\] micro-batches of 2 per replica \(global batch 8\)",
        runs["C"],
    ), runs["C"][-3000:]
    assert "saved as NTP tp_base=2 tp_reduced=1 x 2 replicas" in runs["D"]
    assert "resumed as uniform TP=2 x DP=1" in runs["D"]
    assert "consumed samples:           32" in runs["C"]  # the data goes on from the checkpoint's position


def test_checkpoints_load_bit_identically_between_ntp_and_uniform_tp_base(runs):
    """An NTP job's checkpoint is its healthy replicas' uniform tp_base checkpoint: D (uniform TP2) holds
    after its load exactly what B (NTP, plain optimizer) saved, and C (NTP) exactly what A (uniform TP2,
    distributed optimizer) saved: the same SHA-256 digests of every model and optimizer shard (Adam's moments,
    the distributed optimizer's flat buckets, the step count and param groups). The distributed optimizer's
    state resumes across the two, its TP degree (dp_reshardable format) being the same. Digests change with
    training (iteration 3 vs 6), so equal ones are not a digest that sees nothing."""
    a, b, c, d = (digests(runs[k]) for k in "ABCD")
    for saved, what in ((a, "A"), (b, "B")):
        assert set(saved) == {("saved", 3), ("saved", ITERS)}, (what, saved)
        assert saved["saved", 3][0] != saved["saved", ITERS][0], (what, saved)
        assert saved["saved", 3][1] != saved["saved", ITERS][1], (what, saved)
    assert d == {("loaded", 3): b["saved", 3]}, ("uniform TP2 loading NTP", d, b)
    assert c == {("loaded", 3): a["saved", 3]}, ("NTP loading uniform TP2", c, a)


# ------------------------------------------------------------------------ flags refused at parse time
def _script():
    import importlib.util

    if "pretrain_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pretrain_gpt", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["pretrain_gpt"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["pretrain_gpt"]


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (
            ["--global-batch-size", "10"],
            4,
            "--global-batch-size 10 must be a multiple of --micro-batch-size x data-parallel size = 2 x 4 = 8 "
            "(e.g. 8 or 16)",
        ),
        (
            ["--tensor-model-parallel-size", "3"],
            4,
            "--tensor-model-parallel-size 3 must divide the number of processes",
        ),
        # pipeline parallelism (Megatron-LM's flags and constraints)
        (["--pipeline-model-parallel-size", "3"], 3,
         "--num-layers 2 must be divisible by --pipeline-model-parallel-size 3"),
        (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
         "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4 must divide the number of processes "
         "(6"),
        ([*INTERLEAVED[:2], "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
         "--num-layers-per-virtual-pipeline-stage 3 must divide the layers of each pipeline stage (--num-layers 4 / "
         "--pipeline-model-parallel-size 2 = 2)"),
        (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
         "--num-layers-per-virtual-pipeline-stage 1 cuts the model into 4 chunks, which the interleaved schedule "
         "runs over several pipeline ranks: add --pipeline-model-parallel-size > 1"),
        ([*INTERLEAVED, "--num-layers", "4", "--global-batch-size", "6"], 2,
         "a step has --global-batch-size 6 / (--micro-batch-size 2 x data-parallel size 1) = 3: make it a multiple "
         "of 2 (e.g. --global-batch-size 8)"),
        ([*NTP, "--pipeline-model-parallel-size", "2", "--num-layers", "4"], 6,
         "--ntp-failed-slots: '0:1' names no pipeline stage; with --pipeline-model-parallel-size 2 write "
         "REPLICA,STAGE:SLOTS (e.g. '0,0:1')"),
        ([*NTP_PP, *INTERLEAVED, "--num-layers", "4"], 6,
         "--num-layers-per-virtual-pipeline-stage 1 with --ntp-failed-slots: nonuniform TP does not run interleaved "
         "pipeline schedules"),
        ([*NTP_PP, "--pipeline-model-parallel-size", "2", "--num-layers", "4"], 7,
         "world size 7 + 2 failed GPU(s) is not a multiple of tp_base=2 x pipeline_model_parallel_size=2"),
        (["--pipeline-model-parallel-size", "2", "--refit-transport", "p2p", "--refit-store", "127.0.0.1:1"], 2,
         "--refit-transport p2p (--refit-store, --reshard-refit-*) with --pipeline-model-parallel-size 2"),
        ([*INTERLEAVED, "--num-layers", "4", "--weight-export-target", "127.0.0.1:1", "--weight-export-transport",
          "broadcast"], 2,
         "--refit-target with --num-layers-per-virtual-pipeline-stage 1: the export hook reads one model chunk"),
        (["--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "2"], 2,
         "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 1 = 2 must divide the processes of each "
         "pipeline stage (1 = data-parallel size x --tensor-model-parallel-size 1)"),
        (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 must be divisible by"),
        (NTP, 4, "launch_mode='packed': world size 4 + 1 failed GPU(s) is not a multiple of tp_base=2"),
        (["--ntp-failed-slots", "0:1"], 3, "given without --ntp-tp-base"),
        (["--ntp-transfer-chunk-mb", "8"], 2, "--ntp-transfer-chunk-mb 8.0 given without --ntp-tp-base"),
        ([*NTP, "--ntp-transfer-chunk-mb", "0"], 3, "--ntp-transfer-chunk-mb) must be a number > 0"),
        (["--ntp-tp-base", "2", "--ntp-failed-slots", "0:1;1:1"], 4,
         "--ntp-failed-slots lists 2 degraded replica(s) but the job has only 1 healthy one(s)"),
        (["--weight-export-target", "127.0.0.1:1"], 2, "--refit-target needs --refit-transport broadcast"),
        (["--weight-export-every-n-steps", "2"], 2, "--refit-every-n-steps given without --refit-target"),
        (["--symm-mem", "sometimes"], 2, "argument --symm-mem: invalid choice: 'sometimes'"),
        (["--save-interval", "2"], 2, "--save-interval needs --save DIR"),
        (["--reshard-refit-every-n-steps", "2"], 2, "give --refit-store HOST:PORT"),
        (["--mock-data", "--data-path", "/data/x"], 2, "--mock-data and --data-path: pick one"),
        # MoE
        (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size given without --num-experts N"),
        (["--num-experts", "4", "--expert-model-parallel-size", "3"], 3,
         "--num-experts 4 must be divisible by --expert-model-parallel-size 3"),
        (["--num-experts", "4", "--expert-model-parallel-size", "4"], 2,
         "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 = 4 must divide the number of processes (2"),
        (["--num-experts", "4", "--moe-router-topk", "5"], 2, "--moe-router-topk 5 must be in 1..--num-experts (4)"),
        ([*NTP, "--num-experts", "4"], 3, "--num-experts 4 with --ntp-tp-base: nonuniform TP does not train MoE"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2,
         "megatron-core trains MoE layers under TP only with sequence parallelism: add --sequence-parallel"),
        # sequence parallelism: the sequence splits at the TP degree(s)
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "15"], 2,
         "--seq-length 15 must be divisible by --tensor-model-parallel-size 2 with --sequence-parallel"),
        ([*NTP, "--sequence-parallel", "--seq-length", "15"], 3,
         "NonuniformTPConfig.seq_length=15 (--seq-length) cannot be split over TP degree(s) [2] with "
         "sequence_parallel (--sequence-parallel"),
        (["--ntp-tp-base", "4", "--ntp-failed-slots", "0:1", "--ntp-spares", "1", "--sequence-parallel"], 7,
         "NonuniformTPConfig.seq_length=16 (--seq-length) cannot be split over TP degree(s) [3]"),
        (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 2,
         "--moe-token-dispatcher-type flex needs DeepEP / HybridEP"),
        (["--num-experts", "4", "--moe-grouped-gemm"], 2,
         "--moe-grouped-gemm: grouped-GEMM experts (TEGroupedMLP) need Transformer Engine"),
        (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "z_loss"], 2,
         "argument --moe-router-load-balancing-type: invalid choice: 'z_loss'"),
        (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], 2,
         "--moe-router-load-balancing-type aux_loss seq_aux_loss takes one --moe-aux-loss-coeff each, got 1"),
        (["--num-experts", "4", "--weight-export-target", "127.0.0.1:1", "--weight-export-transport", "broadcast"], 2,
         "refits in Hugging Face Qwen3-MoE naming: add --qk-layernorm (the model must be Qwen3-MoE-shaped)"),
        ([*P2P_MEGATRON, "--refit-engine-ep", "2", "--refit-engine-dp", "2"], 2,
         "--refit-engine-ep 2: the model is dense (no --num-experts)"),
        ([*P2P_MEGATRON, "--num-experts", "4", "--refit-engine-ep", "3", "--refit-engine-dp", "3"], 2,
         "--num-experts 4 must be divisible by --refit-engine-ep 3 (the engine's EP)"),
        ([*P2P_MEGATRON, "--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"], 2,
         "--refit-engine megatron with --moe-router-load-balancing-type sinkhorn"),
    ],
)  # fmt: skip
def test_bad_flag_combinations_are_refused_at_parse_time(flags, world, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        _script().parse_args([*MODEL, *TRAIN, *flags], world_size=world, cuda=False)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_pipeline_flags(monkeypatch):
    """--pipeline-model-parallel-size P splits the processes into TP x PP x DP;
    --num-layers-per-virtual-pipeline-stage N gives each pipeline rank --num-layers / P / N model chunks (one
    chunk: the plain 1F1B schedule, as in Megatron-LM)."""
    monkeypatch.delenv("RANK", raising=False)
    script = _script()
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    plan = script.parse_args([*MODEL, *TRAIN, *flags], world_size=8, cuda=False)[1]
    assert (plan.tp, plan.pp, plan.dp, plan.vp, plan.chunks) == (2, 2, 2, None, 1)
    plan = script.parse_args([*PP_MODEL, *TRAIN, *INTERLEAVED], world_size=2, cuda=False)[1]
    assert (plan.pp, plan.dp, plan.vp, plan.chunks) == (2, 1, 2, 2)
    one_chunk = [*INTERLEAVED[:2], "--num-layers-per-virtual-pipeline-stage", "2"]
    assert script.parse_args([*PP_MODEL, *TRAIN, *one_chunk], world_size=2, cuda=False)[1].vp is None


def test_sequence_parallel_flag(capsys, monkeypatch):
    """--sequence-parallel as in Megatron-LM: off with a warning at TP 1; under --ntp-tp-base on every replica at
    TP > 1 (the config checks the sequence at both degrees; without --ntp-spares the reduced degree splits it:
    TP 2, not 3, for --seq-length 16 at --ntp-tp-base 4); MoE at TP 2 with it (expert TP 2)."""
    monkeypatch.delenv("RANK", raising=False)
    script = _script()
    args, plan = script.parse_args([*MODEL, *TRAIN, "--sequence-parallel"], world_size=2, cuda=False)
    assert not args.sequence_parallel and plan.tp == 1
    assert "WARNING: Disabling sequence parallelism because tensor model parallelism is disabled" in (
        capsys.readouterr().out
    )
    args, plan = script.parse_args([*MODEL, *TRAIN, *NTP, "--sequence-parallel"], world_size=3, cuda=False)
    assert args.sequence_parallel and (plan.ntp.sequence_parallel, plan.ntp.seq_length) == (True, 16)
    wide = ["--hidden-size", "96", "--num-attention-heads", "12", "--num-query-groups", "12"]  # split at 4 and 3
    flags = [*wide, "--ntp-tp-base", "4", "--ntp-failed-slots", "0:1", "--ntp-policy", "degrade"]
    assert script.parse_args([*MODEL, *TRAIN, *flags], world_size=7, cuda=False)[1].ntp.tp_reduced == 3
    args, plan = script.parse_args([*MODEL, *TRAIN, *flags, "--sequence-parallel"], world_size=6, cuda=False)
    assert plan.ntp.tp_reduced == 2 and plan.ntp.non_active_ranks_per_dp == {0: (1, 3)}
    moe = ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args, plan = script.parse_args([*MODEL, *TRAIN, *moe], world_size=2, cuda=False)
    assert args.sequence_parallel and (plan.tp, plan.ep, plan.etp) == (2, 1, 2)


def test_gpt2_shaped_models_are_refused_for_the_weight_export(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    gpt2 = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--vocab-size",
        "128",
    ]
    with pytest.raises(SystemExit):
        _script().parse_args(
            [*gpt2, *TRAIN, "--weight-export-target", "127.0.0.1:1", "--weight-export-transport", "broadcast"],
            world_size=2,
            cuda=False,
        )
    assert (
        "add --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear"
        in capsys.readouterr().err
    )


# ------------------------------------------------------------------------------------------- GPUs
# -------------------------------------------------------------------------------------------------- MoE
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--init-method-std", "0.1"]  # fmt: skip  # larger weights: clear top-k choices and greedy tokens
PROMPTS = [[3, 17, 5, 9, 60], [11, 2, 40], [7, 7, 101, 33, 2, 90, 14]]
NEW_TOKENS = 6
AUX = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| load_balancing_loss: ([0-9.E+-]+) \|")


def _greedy(model):
    """A plain greedy loop over the model's full forward (argmax over Megatron's padded vocabulary, as
    megatron-core's top_k=1), and the smallest top-1 margin it saw."""
    import torch

    from megatron_ext.weight_export import megatron_logits

    tokens, margin = [], float("inf")
    for p in PROMPTS:
        seq = torch.tensor([p])
        for _ in range(NEW_TOKENS):
            top = megatron_logits(model, seq)[0, -1].cpu().topk(2)
            margin = min(margin, (top.values[0] - top.values[1]).item())
            seq = torch.cat([seq, top.indices[:1].view(1, 1)], dim=1)
        tokens.append(seq[0, len(p) :].tolist())
    return tokens, margin


def _main_output(argv: list[str]) -> str:
    """The script's ``main(argv)`` on this one rank of ``run_on_ranks`` (in place of its process group);
    what it printed."""
    import contextlib
    import io

    import torch.distributed as dist

    dist.destroy_process_group()  # main() starts its own
    os.environ["MASTER_PORT"] = str(free_port())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _script().main(argv) == 0
    return out.getvalue()


def _moe_reference(flags, checkpoint):
    """One rank (R): the script's ``main`` at EP1 (its output), then the greedy tokens of the starting
    model (from the seed) and of ``checkpoint`` (E's, saved at EP2) loaded at EP1 by the script's loader."""
    import datetime
    import types

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    script = _script()
    out = _main_output([*MODEL, *TRAIN, *flags])
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    args, plan = script.parse_args([*MODEL, *TRAIN, *flags, "--load", checkpoint, "--no-load-optim"], world_size=1)
    ps.destroy_model_parallel()  # main() leaves megatron-core's groups behind
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = script.build_model(args, plan, script.transformer_config(args, plan, 1), torch.device("cpu"))
    start = _greedy(model)
    iteration, _ = script.load_checkpoint(args, plan, [types.SimpleNamespace(module=model)], None, None)
    return {"out": out, "start": start, "final": _greedy(model), "iteration": iteration}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """E (4 ranks, TP1 x DP4 x EP2) refitting the megatron-core engine command (2 ranks, --tp 1 --ep 2),
    then R (one rank, EP1) in this process's run_on_ranks."""
    import json

    from megatron_ext.testing.multirank import run_on_ranks

    tmp = str(tmp_path_factory.mktemp("pretrain_moe"))
    env = _env(tmp)
    store, ckpt, saved = f"127.0.0.1:{free_port()}", os.path.join(tmp, "ckpt"), os.path.join(tmp, "tokens.json")
    engine = _start(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "megatron_ext.testing.cpu_engine", "--engine", "megatron", "--refit-store", store, "--refit-rank-offset", "4",
         "--tp", "1", "--ep", "2", "--device", "cpu", "--prompt-tokens", *(",".join(map(str, p)) for p in PROMPTS),
         "--generate-tokens", str(NEW_TOKENS), "--save-tokens", saved, "--timeout-s", "240"],
        env, os.path.join(tmp, "engine.log"),
    )  # fmt: skip
    trainer = launch(
        4, *MOE, "--expert-model-parallel-size", "2", "--refit-transport", "p2p", "--refit-store", store,
        "--refit-engine", "megatron", "--refit-engine-dp", "2", "--refit-engine-ep", "2", "--refit-every-n-steps",
        "3", "--save", ckpt, "--data-cache-path", os.path.join(tmp, "cache_e"), env=env, log=os.path.join(tmp, "E.log"),
    )  # fmt: skip
    try:
        out = {"E": finish(trainer, "E (MoE at EP2, refitting the megatron-core engine)")}
        out["engine"] = finish(engine, "the megatron-core engine at --ep 2", timeout=60)
    finally:
        for p in (trainer, engine):
            if p.poll() is None:
                p.terminate()  # torchrun passes SIGTERM on to its workers
                p.wait()
    flags = [*MOE, "--data-cache-path", os.path.join(tmp, "cache_r")]
    keep = {k: env[k] for k in ("XDG_RUNTIME_DIR", "OMP_NUM_THREADS")}
    out["R"] = run_on_ranks(_moe_reference, 1, args=(flags, ckpt), timeout=240, env=keep)[0]
    with open(saved) as f:
        out["tokens"] = json.load(f)
    return out


def test_moe_at_ep2_trains_like_ep1(moe_run):
    """E (TP1 x DP4 x EP2: 2 experts per rank, each expert's gradients reduced over its expert
    data-parallel group of 2) against R (the same flags on one rank, EP1): the same losses and
    load-balancing losses at every iteration (RTOL, module docstring), and the model learns."""
    e, r = moe_run["E"], moe_run["R"]["out"]
    want, got = losses(r), losses(e)
    assert sorted(got) == list(range(1, ITERS + 1)), e[-3000:]
    assert want[ITERS] < want[1] - 0.3, f"the reference did not learn: {want}"
    assert_same_losses(got, want, range(1, ITERS + 1), "MoE EP2 vs EP1")
    aux_e, aux_r = ({int(i): float(v) for i, v in AUX.findall(x)} for x in (e, r))
    assert min(aux_r.values()) > 0.5, aux_r  # the aux loss is on (top-2 of 4 experts: 1 when balanced)
    assert_same_losses(aux_e, aux_r, range(1, ITERS + 1), "MoE load_balancing_loss EP2 vs EP1")
    assert "uniform TP=1 x DP=4 (experts EP=2 x ETP=1)" in e and "DDP wrapper SymmMemDistributedDataParallel" in e
    assert (
        "MoE: 4 experts of ffn 32 per layer, top-2 (top-k, softmax), load balancing aux_loss (coefficient 0.01), "
        "dispatcher allgather; EP=2 x expert TP=1 x expert DP=2, 2 local experts per rank"
    ) in e, e[-3000:]
    assert "EP=1 x expert TP=1 x expert DP=1, 4 local experts per rank" in r, r[-3000:]


def test_moe_refit_to_the_megatron_engine_at_another_ep(moe_run):
    """E refits megatron-core's engine (its command at --tp 1 --ep 2: TP1 x DP2, 2 whole experts per engine
    rank) at start, after iteration 3 and at the end; the engine builds the MoE GPTModel from the config E
    publishes, and its greedy tokens are those of a plain greedy loop over the starting model (version 0)
    and over E's last checkpoint, saved at EP2 and loaded at EP1 (version 6)."""
    e, engine, tokens, ref = moe_run["E"], moe_run["engine"], moe_run["tokens"], moe_run["R"]
    assert re.search(
        r"refit: p2p to the megatron-core engine at 127\.0\.0\.1:\d+ \(refit ranks 4\.\.5, engine TP1 x DP2 x EP2\)",
        e,
    ), e[-3000:]
    assert "megatron-core engine TP1 x DP2 (experts: EP2 x expert TP1) on cpu" in engine, engine[-3000:]
    assert "4 experts top-2 over EP2); serving every version" in engine, engine[-3000:]
    refits = re.findall(r"refit: version (\d+) \(p2p, [^)]*\); engine ranks hold \{4: (\d+), 5: (\d+)\}", e)
    assert refits == [(str(v),) * 3 for v in (0, 3, 6)], e[-3000:]
    assert sorted(tokens, key=int) == ["0", "3", "6"], engine[-3000:]
    (start, start_margin), (final, final_margin) = ref["start"], ref["final"]
    assert ref["iteration"] == ITERS
    assert min(start_margin, final_margin) > 1e-3, (start_margin, final_margin)  # no near-ties
    assert start != final  # training changed the tokens
    assert tokens["0"] == start, (tokens["0"], start)
    assert tokens[str(ITERS)] == final, (tokens[str(ITERS)], final)
    assert f"the trainer closed the refit; the model holds version {ITERS}" in engine, engine[-3000:]


# --------------------------------------------------------------------------------- pipeline parallelism


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    """L: TP2 x PP2 with 2 model chunks per rank (interleaved 1F1B), --sequence-parallel, the distributed
    optimizer and overlapped gradient reduction (4 ranks); M: TP1 x PP2 (plain 1F1B, Megatron's plain
    optimizer, 2 ranks) saving at iteration 3; both launched by torchrun. Meanwhile R0, the same model at PP1 on
    one rank (the script's ``main`` in run_on_ranks), and once M is done R1: the same at PP1 resuming M's
    iteration-3 checkpoint, and N: nonuniform TP at PP2 (NTP_PP, --sequence-parallel, 6 ranks by torchrun) saving at
    iteration 3, then U: uniform TP2 x PP2 (4 ranks) resuming N's iteration-3 checkpoint."""
    from megatron_ext.testing.multirank import run_on_ranks

    tmp = str(tmp_path_factory.mktemp("pretrain_pp"))
    env = _env(tmp)
    ckpt = os.path.join(tmp, "ckpt")
    cache = lambda name: ["--data-cache-path", os.path.join(tmp, f"cache_{name}")]  # noqa: E731 (one per job)
    keep = {k: env[k] for k in ("XDG_RUNTIME_DIR", "OMP_NUM_THREADS")}
    n_run = u_run = None
    l_run = launch(
        4, *INTERLEAVED, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--ddp-bucket-size", "4096", *cache("L"), env=env, log=os.path.join(tmp, "L.log"),
        model=PP_MODEL,
    )  # fmt: skip
    m_run = launch(
        2, "--pipeline-model-parallel-size", "2", *DIGEST, "--save", ckpt, "--save-interval", "3", *cache("M"),
        env=env, log=os.path.join(tmp, "M.log"), model=PP_MODEL,
    )  # fmt: skip
    one_rank = [*PP_MODEL, *TRAIN, *DIGEST, *cache("R")]
    out = {}
    try:
        out["R0"] = run_on_ranks(_main_output, 1, args=(one_rank,), timeout=240, env=keep)[0]
        out["M"] = finish(m_run, "M (TP1 x PP2, saving)")
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
        n_ckpt = os.path.join(tmp, "ckpt_ntp")
        pipelined_sp = ["--pipeline-model-parallel-size", "2", "--sequence-parallel", *DIGEST]
        n_run = launch(
            6, *pipelined_sp, *NTP_PP, "--save", n_ckpt, "--save-interval", "3", *cache("N"), env=env,
            log=os.path.join(tmp, "N.log"), model=PP_MODEL,
        )  # fmt: skip
        out["R1"] = run_on_ranks(_main_output, 1, args=([*one_rank, "--load", ckpt],), timeout=240, env=keep)[0]
        out["L"] = finish(l_run, "L (TP2 x PP2 interleaved, sequence parallel, distributed optimizer)")
        out["N"] = finish(n_run, "N (NTP TP2 -> 1 x PP2, sequence parallel)")
        with open(os.path.join(n_ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
        u_run = launch(
            4, *pipelined_sp, "--tensor-model-parallel-size", "2", "--load", n_ckpt, *cache("U"), env=env,
            log=os.path.join(tmp, "U.log"), model=PP_MODEL,
        )  # fmt: skip
        out["U"] = finish(u_run, "U (uniform TP2 x PP2 resuming N)")
    finally:
        for p in (l_run, m_run, n_run, u_run):
            if p.poll() is None:
                p.terminate()  # torchrun passes SIGTERM on to its workers
                p.wait()
    return out


def test_pipeline_parallel_trains_like_one_stage(pp_runs):
    """L (interleaved 1F1B over TP2 x PP2, sequence parallelism, distributed optimizer, overlapped gradient
    reduction) and M (1F1B over TP1 x PP2) print R0's losses (PP1) at every iteration, within RTOL (module
    docstring: the layouts differ only in the order of reductions; here also the tied embedding's gradient,
    summed on each of its two stages and then over both instead of in one buffer, and the grad norm's squares
    summed per stage). M's first loss is R0's to the last bit: the same weights (each stage draws its layers as
    a PP1 job does), the same forward."""
    want = losses(pp_runs["R0"])
    assert sorted(want) == list(range(1, ITERS + 1)), pp_runs["R0"][-3000:]
    assert want[ITERS] < want[1] - 0.3, f"the reference did not learn: {want}"
    for name in "LM":
        got = losses(pp_runs[name])
        assert sorted(got) == list(range(1, ITERS + 1)), pp_runs[name][-3000:]
        assert_same_losses(got, want, range(1, ITERS + 1), f"{name} (PP2) vs PP1")
    assert losses(pp_runs["M"])[1] == want[1]
    assert (
        "uniform TP=2 x PP=2 (2 model chunks per rank) x DP=1, global batch 8 = 2 x 1 x 4 micro-batches"
    ) in pp_runs["L"]
    assert "DDP wrapper SymmMemDistributedDataParallel, sequence parallel" in pp_runs["L"]
    assert "uniform TP=1 x PP=2 x DP=1, global batch 8" in pp_runs["M"]


def test_pipelined_ntp_trains_like_one_stage(pp_runs):
    """N: --ntp-tp-base 2 at --pipeline-model-parallel-size 2 with --sequence-parallel, replica 0 lost slot 1 of
    stage 1 (6 ranks: each stage holds replica 0 at TP 1 and replica 1 at TP 2; replica 0 the satellite of
    replica 1 in both stages) prints R0's losses (the same script, uniform at PP1) at every iteration, within
    RTOL (module docstring; here also the satellite's gradients added into its partner's before the DP sum)."""
    n = pp_runs["N"]
    want, got = losses(pp_runs["R0"]), losses(n)
    assert sorted(got) == list(range(1, ITERS + 1)), n[-3000:]
    assert_same_losses(got, want, range(1, ITERS + 1), "NTP at PP2 vs uniform PP1")
    assert "replica(s) [0] at TP=1 in all 2 pipeline stages, TP groups [[0], [1, 2], [3], [4, 5]]" in n, n[-3000:]
    assert "degraded -> partner replica 0 -> 1" in n, n[-3000:]


def test_pipelined_ntp_checkpoint_resumes_as_a_uniform_pipeline(pp_runs):
    """N's iteration-3 checkpoint (NTP at PP2: the healthy replica's stages write the uniform TP 2 x PP 2
    checkpoint, the degraded one writes nothing of its own) loads into U, a uniform TP2 x PP2 job: U holds exactly
    what N saved (digests) and goes on as N did (losses 4..6 within RTOL: U computes at TP 2 where N's degraded
    replica computed at TP 1)."""
    n, u = pp_runs["N"], pp_runs["U"]
    assert set(digests(n)) == {("saved", 3), ("saved", ITERS)}, n[-3000:]
    assert digests(n)["saved", 3] != digests(n)["saved", ITERS]  # a digest that sees the training
    assert digests(u) == {("loaded", 3): digests(n)["saved", 3]}, (u[-3000:], n[-3000:])
    got = losses(u)
    assert sorted(got) == [4, 5, 6], u[-3000:]
    assert_same_losses(got, losses(n), range(4, ITERS + 1), "uniform TP2 x PP2 resumed from NTP at PP2")


def test_pipeline_checkpoint_resumes_at_one_stage(pp_runs):
    """R1 (PP1) resumes M's iteration-3 checkpoint (PP2: each stage wrote its own layers, under their global
    numbers, the first the embedding and the last stage not its tied copy): it holds exactly what M saved
    (model and optimizer digests) and goes on as M did; its first loss is M's to the last bit (the same weights,
    the same forward)."""
    m, r1 = pp_runs["M"], pp_runs["R1"]
    assert set(digests(m)) == {("saved", 3), ("saved", ITERS)}, m[-3000:]
    assert digests(r1) == {("loaded", 3): digests(m)["saved", 3]}, (r1[-3000:], m[-3000:])
    assert "saved as uniform TP=1 x PP=2 x DP=1; resumed as uniform TP=1 x DP=1" in r1
    got, want = losses(r1), losses(m)
    assert sorted(got) == [4, 5, 6], r1[-3000:]
    assert got[4] == want[4]
    assert_same_losses(got, want, range(4, ITERS + 1), "PP1 resumed from PP2")


def test_p2p_refit_to_an_engine_started_on_its_own(runs):
    """D (Megatron TP2, resumed at iteration 3) refits each engine rank's own shards, here one TP1 replica
    (python -m megatron_ext.weight_export.engine --refit-store), point to point from the trainer ranks that
    own them: at start (version 3), every 2 iterations (4, 6), the end not twice; the engine takes the
    trainer's layout and specs from the trainer and acknowledges the version it holds."""
    engine, d = runs["engine_p2p"], runs["D"]
    assert re.search(
        r"refit: p2p to the engine at 127\.0\.0\.1:\d+ \(refit ranks 2\.\.2, engine TP1 x DP1\) at start, every 2 "
        r"iterations and at the end; \d+ HF tensors",
        d,
    ), d[-3000:]
    for version in (3, 4, 6):
        assert f"engine: applied version {version}\n" in engine, engine
        assert re.search(rf"refit: version {version} \(p2p, .*\); engine ranks hold \{{2: {version}\}}", d), d[-3000:]
    assert engine.count("engine: applied version") == 3, engine
    assert "the trainer closed the refit; the model holds version 6" in engine, engine


def _export_run(tmp_path, env, engine_device, nproc, transport, *flags):
    """A GPU job exporting every 3 iterations to an engine started on its own on ``engine_device``:
    the engine applies versions 0, 3 and 6 and ends holding 6. Returns the job's output."""
    port = free_port()
    engine = engine_command(
        hf_model_dir(str(tmp_path / "hf")), f"127.0.0.1:{port}", engine_device, env, str(tmp_path / "engine.log")
    )
    try:
        out = finish(
            launch(
                nproc,
                *flags,
                "--weight-export-target",
                f"127.0.0.1:{port}",
                "--weight-export-transport",
                transport,
                "--weight-export-every-n-steps",
                "3",
                env=env,
                log=str(tmp_path / "A.log"),
            ),
            f"{nproc} GPU(s) exporting over {transport}",
        )
        out_engine = finish(engine, f"the engine on {engine_device}", timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert all(f"engine applied [{v}]" in out for v in (0, 3, 6)), out[-3000:]
    assert "session 1 ended; the model holds version 6" in out_engine, out_engine
    return out


@pytest.mark.gpus(4)
def test_gpu_ntp_symm_export_and_resume(tmp_path):
    """The same commands on NCCL: uniform TP1 x DP2 exporting to an engine on the 4th GPU; NTP on 3 GPUs
    with symmetric memory on (its buckets staged in NCCL symmetric memory), loss parity with the uniform
    run; a uniform TP2 job resuming the NTP checkpoint bit for bit; and an NTP job with --bf16, the distributed
    optimizer and overlapped gradient reduction resuming its own checkpoint exactly."""
    env = _env(str(tmp_path))
    log = lambda name: str(tmp_path / f"{name}.log")  # noqa: E731
    gpu = ["--use-cpu-initialization"]  # the same global model at every TP degree (NTP needs it on GPUs)
    ck, ck_bf16 = str(tmp_path / "ckpt_ntp"), str(tmp_path / "ckpt_ntp_bf16")
    out_a = _export_run(tmp_path, env, "cuda:3", 2, "broadcast", *gpu, "--symm-mem", "off")
    assert "mem (GiB) allocated:" in out_a
    out_b = finish(
        launch(3, *gpu, *NTP, *DIGEST, "--symm-mem", "on", "--save", ck, "--save-interval", "3", env=env, log=log("B")),
        "NTP on 3 GPUs",
    )
    a, b = losses(out_a), losses(out_b)
    assert_same_losses(b, a, range(1, ITERS + 1), "NTP vs uniform on NCCL")
    assert re.search(r"symmetric memory: mode=on, [1-9]\d* of \d+ bucket buffers symmetric", out_b), out_b[-3000:]
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    out_d = finish(
        launch(2, *gpu, *DIGEST, "--tensor-model-parallel-size", "2", "--load", ck, env=env, log=log("D")),
        "uniform TP2 on 2 GPUs resuming the NTP checkpoint",
    )
    assert_same_losses(losses(out_d), b, range(4, ITERS + 1), "uniform TP2 resumed from NTP on NCCL")
    assert digests(out_d) == {("loaded", 3): digests(out_b)["saved", 3]}, (out_d[-3000:], out_b[-3000:])
    bf16 = [
        *gpu,
        *NTP,
        *DIGEST,
        "--bf16",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--ddp-bucket-size",
        "4096",
    ]
    out_f = finish(
        launch(3, *bf16, "--save", ck_bf16, "--save-interval", "3", env=env, log=log("F")),
        "NTP bf16 + distributed optimizer on 3 GPUs",
    )
    with open(os.path.join(ck_bf16, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    out_g = finish(launch(3, *bf16, "--load", ck_bf16, env=env, log=log("G")), "the same job resuming")
    assert_same_losses(losses(out_g), losses(out_f), range(4, ITERS + 1), "NTP bf16 + distributed optimizer resumed")
    assert digests(out_g) == {("loaded", 3): digests(out_f)["saved", 3]}, (out_g[-3000:], out_f[-3000:])


@pytest.mark.gpus(1)
def test_one_gpu_export_over_cuda_ipc_and_bf16_distributed_optimizer_resume(tmp_path):
    """One GPU: export over CUDA IPC to an engine on the same GPU (started on its own), and a --bf16 job with
    the distributed optimizer and overlapped gradient reduction resuming its own checkpoint exactly."""
    env = _env(str(tmp_path))
    log = lambda name: str(tmp_path / f"{name}.log")  # noqa: E731
    ck = str(tmp_path / "ckpt")
    out_a = _export_run(tmp_path, env, "cuda:0", 1, "ipc", "--symm-mem", "on")
    assert "mem (GiB) allocated:" in out_a and "symmetric memory: mode=on" in out_a, out_a[-3000:]
    bf16 = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "4096"]
    out_f = finish(launch(1, *bf16, "--save", ck, "--save-interval", "3", env=env, log=log("F")), "bf16 on one GPU")
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    out_g = finish(launch(1, *bf16, "--load", ck, env=env, log=log("G")), "the same job resuming")
    assert_same_losses(losses(out_g), losses(out_f), range(4, ITERS + 1), "bf16 + distributed optimizer resumed")
