"""The export hook with the trainer and the engine as independent processes, each started
by its own command (``python -m megatron_ext.weight_export.engine`` and
``python -m megatron_ext.testing.export_trainer``), with the faults deployments hit:
strangers on the engine's port, the trainer killed mid-refit, non-finite weights, an
engine stopped before the handshake. The engine keeps its previous complete version
bit for bit (or says it holds none), and every wait is bounded. An engine started without
``--model`` builds its Hugging Face model from the config the trainer sends (the hook, with
its plan) or publishes (the p2p refit, with its layout); a ``--model`` that is not a Hugging
Face model directory is refused in one line, at parse time."""

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import free_port

SPEC = tiny_llama.TinyLlamaSpec()  # the export trainer's default model


@pytest.fixture
def env(tmp_path):
    """Both commands' environment: a private key directory (the engine creates the loopback key there)."""
    keys = tmp_path / "run"
    keys.mkdir(mode=0o700)
    return {**os.environ, "XDG_RUNTIME_DIR": str(keys), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "hf_model"
    tiny_llama.build_hf(SPEC).save_pretrained(path)
    return path


def _engine(model_dir, address, env, *extra):
    """The engine command at ``address``; ``model_dir`` None: without ``--model`` (built from the trainer's config)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_ext.weight_export.engine",
            *([] if model_dir is None else ["--model", str(model_dir)]),
            "--address",
            address,
            "--device",
            "cpu",
            "--timeout-s",
            "90",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_listening(port: int, proc, timeout_s: float = 90) -> None:
    """Until the engine accepts TCP (each probe is a bare connect: the engine must shrug it off)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the engine did not listen at {port} within {timeout_s}s")


def _trainer(address, out, env, *extra, timeout=180):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.testing.export_trainer", "--target", address, "--out", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, torch.load(out, weights_only=False), time.monotonic() - start


def _saved_state(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _assert_holds(state, sent):
    assert state.keys() == sent.keys()
    for name, t in sent.items():
        assert torch.equal(state[name], t), name


def test_engine_keeps_its_complete_version_through_strangers_a_killed_trainer_and_nan(tmp_path, env, model_dir):
    port = free_port()
    address = f"127.0.0.1:{port}"
    saved = tmp_path / "after"
    engine = _engine(model_dir, address, env, "--sessions", "2", "--save", str(saved))
    try:
        _wait_listening(port, engine)
        for payload in (b"GET / HTTP/1.0\r\n\r\n", os.urandom(100), b"\x00\x00\x10\x00{"):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(payload)
        # Session 1: version 1 (and the verifier's forward pass across processes), then the
        # trainer is SIGKILLed after 3 buckets of version 2 have reached the engine.
        killed, first, _ = _trainer(
            address, tmp_path / "t1.pt", env, "--verify", "--kill-in-version", "2", "--kill-after-buckets", "3"
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert first["applied"] == [(1,)] and first["error"] is None and 2 in first["sent"]
        assert first["kl"] is not None and first["kl"] < 1e-6
        # Session 2: version 1 again, then a NaN weight: version 2 is refused by name, never published.
        nan, second, _ = _trainer(address, tmp_path / "t2.pt", env, "--nan-in-version", "2")
        assert nan.returncode == 3 and second["error_type"] == "NonFiniteWeights", second["error"]
        assert "NaN/Inf in 1 tensor(s): model.embed_tokens.weight" in second["error"]
        assert second["applied"] == [(1,)]
        out, _ = engine.communicate(timeout=120)
    finally:
        engine.kill()
    assert engine.returncode == 0, out
    assert out.count("session 1 ended; the model holds version 1") == 1, out
    assert out.count("session 2 ended; the model holds version 1") == 1, out
    assert "dropped a connection" in out, out  # the strangers were logged, not fatal
    _assert_holds(_saved_state(saved), first["sent"][1])  # bit for bit: nothing of the killed or NaN version
    assert not torch.equal(first["sent"][2]["model.norm.weight"], first["sent"][1]["model.norm.weight"])


def test_streaming_engine_reports_no_complete_version_and_a_stopped_engine_fails_the_trainer_in_time(
    tmp_path, env, model_dir
):
    """The first engine has no --model: it builds its model from the Hugging Face config the trainer sends
    with its plan (NaN weights until version 1), and the verifier's logits from it match the trainer's."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    engine = _engine(None, address, env, "--no-atomic", "--sessions", "2")
    try:
        killed, first, _ = _trainer(
            address, tmp_path / "t1.pt", env, "--verify", "--kill-in-version", "2", "--kill-after-buckets", "3"
        )
        assert killed.returncode == -signal.SIGKILL and first["applied"] == [(1,)], killed.stderr[-3000:]
        # The model built from the trainer's config is the trainer's: the same fp32 logits up to reduction order
        # (1.3e-7 apart here, as from the saved --model directory; a RoPE base off by 2x puts them 5e-4 apart,
        # which the KL of this tiny model's near-uniform distributions does not see).
        assert first["logit_diff"] is not None and first["logit_diff"] < 1e-5, (first["logit_diff"], first["kl"])
        assert first["kl"] < 1e-6, first["kl"]
        # The next trainer (another model: its plan is refused, nothing written) does not make the
        # engine forget that it holds no complete version.
        other, second, _ = _trainer(address, tmp_path / "t2.pt", env, "--spec", '{"ffn_hidden_size": 128}')
        assert other.returncode == 3 and second["error_type"] == "PlanMismatch", second["error"]
        assert "model differs (intermediate_size 96 vs 128): restart the engine" in second["error"], second["error"]
        out, _ = engine.communicate(timeout=120)
    finally:
        engine.kill()
    assert "engine: serving the trainer's model (built from its config at its first plan)" in out, out
    assert engine.returncode == 0 and "session 1 ended; the model holds no complete version" in out, out
    assert "session 2 ended; the model holds no complete version" in out, out
    # An engine stopped (SIGSTOP) before the handshake: the trainer's wait is bounded by its timeout.
    port = free_port()
    address = f"127.0.0.1:{port}"
    engine = _engine(model_dir, address, env)
    try:
        _wait_listening(port, engine)
        engine.send_signal(signal.SIGSTOP)
        stopped, got, seconds = _trainer(address, tmp_path / "t2.pt", env, "--timeout-s", "5")
        assert stopped.returncode == 3 and got["error_type"] == "ReceiverError", got["error"]
        assert f"the weight receiver at {address} did not answer in time" in got["error"], got["error"]
        assert seconds < 60, f"the trainer took {seconds:.0f}s with --timeout-s 5"
    finally:
        engine.send_signal(signal.SIGCONT)
        engine.kill()
        engine.communicate()


@pytest.mark.gpus(1)
@pytest.mark.parametrize("transport", ["ipc", "ipc-direct", "ipc-push"])
def test_same_gpu_engine_as_its_own_process(tmp_path, env, model_dir, transport):
    """CUDA IPC between two independent processes on one GPU: the handles travel as JSON
    fields of the control channel. Session 1 refits twice and runs the verifier. Session 2's
    first version has a NaN in the embedding: refused by name, found by the copy that moves it
    (``ipc``: the trainer's gather into the shared buffers, so the engine keeps version 2;
    ``ipc-push``: the trainer's writes into the engine's weights; ``ipc-direct``: the engine's own
    copy out of the trainer's storage; both in place: no complete version).
    Session 3's trainer is SIGKILLed inside version 2 (``ipc``: after one bucket; the in-place
    transports send no buckets: after all bytes, before the commit). ``ipc`` stages (the engine
    keeps version 1 bit for bit); ``ipc-direct`` and ``ipc-push`` write in place (the engine
    says it holds no complete version)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    saved = tmp_path / "after"
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_ext.weight_export.engine",
            "--model",
            str(model_dir),
            "--address",
            address,
            "--device",
            "cuda",
            "--timeout-s",
            "90",
            "--sessions",
            "3",
            "--save",
            str(saved),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_listening(port, engine)
        ok, first, _ = _trainer(
            address, tmp_path / "t1.pt", env, "--device", "cuda", "--transport", transport, "--verify"
        )
        assert ok.returncode == 0 and first["error"] is None, (first["error"], ok.stderr[-3000:])
        assert first["applied"] == [(1,), (2,)]
        # Same fp32 weights and the same tokens on one GPU; the engine (HF) and Megatron differ
        # only in kernel choice and reduction order: fp32 logits agree to ~1e-5, KL ~1e-10.
        assert first["kl"] is not None and first["kl"] < 1e-6, first["kl"]
        nan, second, _ = _trainer(
            address, tmp_path / "t2.pt", env, "--device", "cuda", "--transport", transport, "--nan-in-version", "1"
        )
        assert nan.returncode == 3 and second["error_type"] == "NonFiniteWeights", second["error"]
        assert "NaN/Inf in 1 tensor(s): model.embed_tokens.weight" in second["error"], second["error"]
        assert second["applied"] == []
        after = "1" if transport == "ipc" else "0"
        killed, third, _ = _trainer(
            address,
            tmp_path / "t3.pt",
            env,
            "--device",
            "cuda",
            "--transport",
            transport,
            "--kill-in-version",
            "2",
            "--kill-after-buckets",
            after,
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert third["applied"] == [(1,)]
        out, _ = engine.communicate(timeout=120)
    finally:
        engine.kill()
    assert engine.returncode == 0, out
    assert "session 1 ended; the model holds version 2" in out, out
    if transport != "ipc":  # the NaN version was written in place by the copy that found it
        assert "session 2 ended; the model holds no complete version" in out, out
    else:
        assert "session 2 ended; the model holds version 2" in out, out
    if transport == "ipc":
        assert "session 3 ended; the model holds version 1" in out, out
        _assert_holds(_saved_state(saved), third["sent"][1])
    else:
        assert "session 3 ended; the model holds no complete version" in out, out


def _knock_then_cue(port, engine, knocked, cue):
    """Once the trainer's store is up: a health check, HTTP and garbage at it, each on its own connection;
    then ``cue`` lets the trainer (held with ``--hold-until``) start refitting."""
    deadline = time.monotonic() + 90
    while engine.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()  # the health check
            break
        except OSError:
            time.sleep(0.02)  # the store is not up yet
    knocked.append(b"")
    for payload in (b"GET / HTTP/1.0\r\n\r\n", os.urandom(64)):
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(payload)
        knocked.append(payload)
    time.sleep(0.5)  # the store's threads log the drops as each connection closes
    cue.touch()


@pytest.mark.parametrize("atomic", [True, False, "host"], ids=["atomic", "streaming-no-model", "atomic-host-budget"])
def test_p2p_engine_keeps_its_version_when_the_trainer_is_killed_mid_refit(tmp_path, env, model_dir, atomic):
    """The p2p refit with both sides as commands of their own: the engine command joins the trainer's
    refit group (``--refit-store``), takes version 1 while strangers knock at the store (logged and
    dropped by the trainer, which hosts it), then the trainer is SIGKILLed after 3 rounds of version 2.
    The engine fails at once, naming the dead peer, and its model holds version 1 bit for bit: it loads
    a version only when all of it arrived (a streaming engine's staging tensors are mixed, its model
    is not). The streaming engine has no --model: it builds its model from the Hugging Face config the
    trainer publishes with its layout, and the model it saves gives the logits of the trainer's HF model.
    ``atomic-host-budget``: both sides under --memory-budget-mb, the engine keeping each version in host
    memory (--atomic-staging host) until all of it arrived. The streaming engine and its trainer also send
    zero-copy (--zero-copy-mb): runs of 4 KiB or more go into the engine's tensors without staging."""
    store = f"127.0.0.1:{free_port()}"
    saved = tmp_path / "after"
    p2p = ["--refit-store", store, "--refit-rank", "1", "--refit-world-size", "2", "--bucket-size-mb", "0.004"]
    budget = ["--memory-budget-mb", "0.016"] if atomic == "host" else []
    zero_copy = [] if atomic else ["--zero-copy-mb", "0.004"]  # 4 KiB and more: most of the tiny model's tensors
    p2p += budget + zero_copy + (["--atomic-staging", "host"] if atomic == "host" else [])
    model = ["--model", str(model_dir)] if atomic else []
    engine = subprocess.Popen(
        [sys.executable, "-m", "megatron_ext.weight_export.engine", *model, *p2p, "--device",
         "cpu", "--timeout-s", "90", "--save", str(saved), *([] if atomic else ["--no-atomic"])],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    knocked, cue = [], tmp_path / "knocked"
    knocker = threading.Thread(target=_knock_then_cue, args=(int(store.rsplit(":", 1)[1]), engine, knocked, cue))
    try:
        knocker.start()  # strangers at the trainer's store once it is up; the refit waits for them
        killed, sent, _ = _trainer(
            store, tmp_path / "t.pt", env, "--transport", "p2p", "--bucket-size-mb", "0.004",
            "--kill-in-version", "2", "--kill-after-buckets", "3", "--hold-until", str(cue), *budget, *zero_copy,
        )  # fmt: skip
        start = time.monotonic()
        try:
            out, _ = engine.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            engine.kill()
            pytest.fail(f"the engine did not exit within 60 s of the trainer's death:\n{engine.communicate()[0]}")
    finally:
        engine.kill()
    knocker.join(30)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sent["applied"] == [(1,)] and sent["error"] is None and 2 in sent["sent"], sent["error"]
    assert len(knocked) == 3 and killed.stderr.count(f"refit store at {store}: dropped a connection") >= 3, (
        knocked,
        killed.stderr[-3000:],
    )
    assert time.monotonic() - start < 30, out  # the engine learnt of the death from its connections
    assert engine.returncode == 1 and "engine: applied version 1\n" in out, out
    assert "engine: error: RefitGroupError: refit rank 1: recv from refit rank 0 failed" in out, out
    _assert_holds(_saved_state(saved), sent["sent"][1])
    assert not torch.equal(sent["sent"][2]["model.norm.weight"], sent["sent"][1]["model.norm.weight"])
    if not atomic:  # the saved model (its config the trainer's published one) is the trainer's HF model
        import transformers

        built = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
        reference = tiny_llama.build_hf(SPEC)
        reference.load_state_dict(sent["sent"][1])
        tokens = tiny_llama.tokens(SPEC)
        with torch.no_grad():
            got, want = built(input_ids=tokens).logits, reference(input_ids=tokens).logits
        assert type(built) is type(reference) and torch.equal(got, want), (type(built), (got - want).abs().max())


def _bad_model(tmp_path, kind):
    path = tmp_path / "m"
    if kind == "file":
        path.write_text("not a model")
    elif kind in ("empty", "bad config", "no weights"):
        path.mkdir()
        if kind == "bad config":
            (path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
        elif kind == "no weights":
            tiny_llama.build_hf(SPEC).config.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "kind, why",
    [
        ("missing", "no such directory"),
        ("file", "not a directory"),
        ("empty", "no config.json in it"),
        ("bad config", "its config.json does not load (OSError: "),
    ],
)
def test_a_model_path_that_is_no_hf_model_directory_is_refused_at_parse_time(tmp_path, capsys, kind, why):
    """--model PATH: a missing path, a file, a directory without config.json or with one that does not load:
    argparse's exit 2 and its error line alone, naming the path and what to pass (not transformers' traceback)."""
    from megatron_ext.weight_export import engine as engine_command

    path = _bad_model(tmp_path, kind)
    with pytest.raises(SystemExit) as exit_info:
        engine_command._args(["--model", path, "--address", "127.0.0.1:29600"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # the error alone, without argparse's usage
    line = err.strip()
    assert line.startswith(f"python -m megatron_ext.weight_export.engine: error: --model {path}: {why}"), err
    assert line.endswith(
        "pass a Hugging Face model directory (config.json + weights) or leave --model out to build the model from "
        "the trainer's config"
    ), err
    assert "Traceback" not in err, err


def test_a_model_directory_without_weights_fails_in_one_line_and_a_missing_one_as_a_command(tmp_path, env):
    """A config without weights passes the parse and fails at loading, in one line (exit 1); the command
    as users run it refuses a missing --model with exit 2 before it imports a model or listens."""
    from megatron_ext.weight_export import engine as engine_command

    path = _bad_model(tmp_path, "no weights")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = engine_command.main(["--model", path, "--address", f"127.0.0.1:{free_port()}", "--device", "cpu"])
    assert code == 1 and err.getvalue().count("\n") == 1, err.getvalue()
    assert err.getvalue().startswith(f"engine: error: --model {path}: cannot load the model ("), err.getvalue()
    missing = str(tmp_path / "no_such_model")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.weight_export.engine", "--model", missing, "--address", "127.0.0.1:1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        f"python -m megatron_ext.weight_export.engine: error: --model {missing}: no such directory; pass a Hugging "
        "Face model directory"
    ), proc.stderr
