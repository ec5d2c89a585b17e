"""Reshard refit between a Megatron trainer job and a SEPARATE engine job (own
default worlds, one RefitGroup over the refit store): the engine's tensors equal the
export hook's HF weights exactly after each version, a mismatched version or plan
is refused with RefitRejected, an engine rank with wrong tensors is refused on
every rank within seconds, naming it, a missing peer fails within the timeout
with a message naming it (no hang), a trainer killed mid-refit leaves an atomic
engine at its previous version and a streaming one at none, and the store
listens only on the address it is given."""

import multiprocessing
import os
import re
import socket
import subprocess
import threading
import time

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import free_port, run_two_jobs

from ._reference import hook_reference

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")  # QKV bias: a fused 1-D tensor too
BUCKET = 4096  # small buckets: many rounds
ZERO_COPY = 1024  # helper B: contiguous runs of at least this many bytes are sent from the trainer's tensors
# the phased helper (engine B's layout, TP1 x DP2: each engine rank takes both TP shards): 2 peers per rank of the
# 2 x 2 jobs split 8 KiB into 2 KiB buckets in one round; in 2 phases (one peer per round) 3.75 KiB ones
# (plan/budget.py); with 1 peer each, one phase
PHASED_BUDGET = 8192
QKV = "model.layers.0.self_attn.qkv_proj.weight"  # an engine tensor (TP-sharded)


def _specs(n_trainer):
    from megatron_ext.sharding import specs_from_config

    cfg = tiny_llama.transformer_config(SPEC, tp=n_trainer)
    return specs_from_config(
        cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size, tie_embeddings=SPEC.tie_embeddings
    )


def _layouts(specs, n_trainer, n_engine):
    """Trainer TP=T at refit ranks 0..T-1; engine A: TP=E (in place), engine B: TP1 x DP=E (load_weights)."""
    from megatron_ext.sharding import megatron_layout
    from megatron_ext.weight_export.plan.layout import inference_layout

    engine = range(n_trainer, n_trainer + n_engine)
    return (
        megatron_layout(specs, tp=n_trainer, ranks=range(n_trainer)),
        inference_layout(specs, tp=n_engine, ranks=engine),
        inference_layout(specs, tp=1, dp=n_engine, ranks=engine),
    )


def _device(backend):
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _trainer_body(backend, port, n_engine):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    n_trainer, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=n_trainer)
    cfg = tiny_llama.transformer_config(SPEC, tp=n_trainer)
    model = tiny_llama.build_model(SPEC, cfg, device=_device(backend))
    exporter, got = hook_reference(model, SPEC.hf_vocab_size)  # the reference, gathered to rank 0
    group = wx.RefitGroup.join("127.0.0.1", port, rank, n_trainer + n_engine, backend=backend, timeout_s=60)
    specs = wx.specs_from_model(model, vocab_size=SPEC.hf_vocab_size)
    src, dst_a, dst_b = _layouts(specs, n_trainer, n_engine)
    live = wx.megatron_layout_from_groups(specs)  # read from parallel_state, not typed
    tensors = wx.megatron_tensors(model)
    out = {"specs_match": specs == _specs(n_trainer), "live_layout": live.tensors == src.tensors}
    src = live
    refit = wx.TrainerRefit(group, src, dst_a, tensors, bucket_bytes=BUCKET)
    for v in (1, 2):
        if v == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-0.5).add_(0.125)  # the next version (the same on every replica)
        exporter.export(version=v)
        out[f"ref{v}"] = {n: t.clone() for n, t in got.items()} if rank == 0 else None
        out[f"stats{v}"] = refit.refit(v)
        out[f"acks{v}"] = refit.engine_versions()
    out["stats3"] = refit.refit(3)  # the engine expects version 4: refused
    out["acks3"] = refit.engine_versions()
    # within a budget that puts the pairs in phases: the words gathered through the store, across the two jobs
    phased = wx.TrainerRefit(group, src, dst_b, tensors, bucket_bytes=BUCKET, memory_budget_bytes=PHASED_BUDGET)
    out["stats6"], out["phases6"] = phased.refit(6), phased.executor.phases
    try:  # the engine asks for zero-copy transfers, the trainer stages: refused on every rank before a byte moves
        wx.TrainerRefit(group, src, dst_a, tensors, bucket_bytes=BUCKET)
        out["plan"] = None
    except wx.RefitRejected as e:
        out["plan"] = (e.reason, str(e))
    start = time.monotonic()
    try:  # an engine rank's qkv has another dtype: every rank refuses at once, quoting it (timeout: 60 s)
        wx.TrainerRefit(group, src, dst_a, tensors, bucket_bytes=BUCKET)
        out["tensors"] = None
    except wx.RefitRejected as e:
        out["tensors"] = (e.reason, str(e), time.monotonic() - start)
    # a second helper on the group, sending zero-copy (received into staging: the engine loads whole versions)
    refit_b = wx.TrainerRefit(group, src, dst_b, tensors, bucket_bytes=BUCKET, zero_copy_bytes=ZERO_COPY)
    out["stats5"] = refit_b.refit(5)
    out["acks5"] = refit_b.engine_versions()
    out["zero_copy5"] = refit_b.executor.staging_plan.direct_bytes.get(rank, 0)
    refit_b.close()  # the engine's serve() loop returns
    group.close()
    return out


def _engine_body(backend, port, n_trainer):
    import torch.distributed as dist

    from megatron_ext import weight_export as wx

    n_engine = dist.get_world_size()
    rank = n_trainer + dist.get_rank()  # refit rank
    group = wx.RefitGroup.join("127.0.0.1", port, rank, n_trainer + n_engine, backend=backend, timeout_s=60)
    src, dst_a, dst_b = _layouts(_specs(n_trainer), n_trainer, n_engine)  # no Megatron model on this side

    def snap(tensors):
        return {n: t.cpu().clone() for n, t in tensors.items()}

    # A: the engine's own tensors (vLLM-style fused shards) are written in place
    own = {n: torch.full(lt.shape, float("nan"), device=group.device) for n, lt in dst_a.tensors[rank].items()}
    refit = wx.EngineRefit(group, None, dst_a, own, bucket_bytes=BUCKET)  # the trainer sends its layout
    out = {}
    for v in (1, 2):
        out[f"stats{v}"] = refit.refit()  # the announced version
        out[f"engine{v}"], out[f"version{v}"] = snap(own), refit.version
    try:
        refit.refit(4)
        out["refused"] = None
    except wx.RefitRejected as e:
        out["refused"] = (e.reason, str(e))
    out["engine3"], out["version3"] = snap(own), refit.version
    fresh = {n: torch.full(lt.shape, float("nan"), device=group.device) for n, lt in dst_b.tensors[rank].items()}
    phased = wx.EngineRefit(
        group, src, dst_b, fresh, bucket_bytes=BUCKET, atomic=False, memory_budget_bytes=PHASED_BUDGET
    )
    out["stats6"], out["phases6"] = phased.refit(), phased.executor.phases
    out["engine6"], out["version6"] = snap(fresh), phased.version
    try:
        wx.EngineRefit(group, src, dst_a, own, bucket_bytes=BUCKET, zero_copy_bytes=4096)
        out["plan"] = None
    except wx.RefitRejected as e:
        out["plan"] = (e.reason, str(e))
    bad = dict(own)
    if rank == n_trainer + n_engine - 1:  # the last engine rank
        bad[QKV] = own[QKV].half()
    start = time.monotonic()
    try:
        wx.EngineRefit(group, src, dst_a, bad, bucket_bytes=BUCKET)
        out["tensors"] = None
    except wx.RefitRejected as e:
        out["tensors"] = (e.reason, str(e), time.monotonic() - start)
    # B: TP1 replicas; after each version the whole HF tensors go to load_weights (as a vLLM worker would)
    loaded = {}
    refit_b = wx.EngineRefit(
        group,
        src,
        dst_b,
        load_weights=lambda ws: loaded.update({n: t.cpu().clone() for n, t in ws}),
        bucket_bytes=BUCKET,
        zero_copy_bytes=ZERO_COPY,
    )
    seen = []
    out["served"] = refit_b.serve(on_version=lambda s: seen.append(s.version))
    out["seen"], out["loaded"] = seen, loaded
    group.close()
    return out


def _run_both(backend, n_trainer, n_engine, timeout=240):
    """The trainer job and the engine job, each its own run_on_ranks world, at the same time."""
    port, nccl = free_port(), backend == "nccl"
    return run_two_jobs(
        dict(fn=_trainer_body, world_size=n_trainer, args=(backend, port, n_engine), backend=backend,
             timeout=timeout, env={"CUDA_VISIBLE_DEVICES": "0"} if nccl else None),
        dict(fn=_engine_body, world_size=n_engine, args=(backend, port, n_trainer), backend=backend,
             timeout=timeout, env={"CUDA_VISIBLE_DEVICES": "1"} if nccl else None),
    )  # fmt: skip


def _check(engine, ref, dst, r, label):
    """``engine`` (refit rank ``r``'s local tensors) equals the HF weights cut by the engine layout."""
    for n, lt in dst.tensors[r].items():
        want = torch.cat([ref[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments])
        torch.testing.assert_close(engine[n], want, rtol=0, atol=0, msg=f"{label} refit rank {r} {n}")


@pytest.mark.parametrize(
    "backend,n_trainer,n_engine", [("gloo", 2, 2), pytest.param("nccl", 1, 1, marks=pytest.mark.gpus(2))]
)
def test_remote_refit_exact(backend, n_trainer, n_engine):
    trainer, engine = _run_both(backend, n_trainer, n_engine)
    src, dst_a, dst_b = _layouts(_specs(n_trainer), n_trainer, n_engine)
    ref1, ref2 = trainer[0]["ref1"], trainer[0]["ref2"]
    assert all(t["specs_match"] for t in trainer)
    assert all(t["live_layout"] for t in trainer)  # megatron_layout_from_groups == the typed layout
    assert any(not torch.equal(ref1[n], ref2[n]) for n in ref1)
    engine_ranks = list(range(n_trainer, n_trainer + n_engine))
    for i, r in enumerate(engine_ranks):
        res = engine[i]
        for v, ref in ((1, ref1), (2, ref2)):
            _check(res[f"engine{v}"], ref, dst_a, r, f"version {v}")
            assert res[f"version{v}"] == v and res[f"stats{v}"].received_bytes > 0
        # a version the engine did not ask for: refused, tensors still version 2
        reason, msg = res["refused"]
        assert reason == "version" and "serves version 3" in msg, msg
        # the phased helper: version 2's weights, served as 6, exactly, into tensors that held NaN
        assert res["version6"] == 6 and res["phases6"] == (2 if n_engine > 1 else 1), res["phases6"]
        _check(res["engine6"], ref2, dst_b, r, "version 6 in phases")
        assert res["version3"] == 2
        for n, t in res["engine3"].items():
            assert torch.equal(t, res["engine2"][n]), n
        # another zero-copy setting: every rank refuses the plan when the helpers are built (another bucket size
        # is not refused: each rank plans its own pairs and a pair takes the smaller of its two ranks' slots)
        reason, msg = res["plan"]
        assert reason == "plan" and f"refit ranks {engine_ranks}" in msg, msg
    # wrong tensors on the last engine rank: every rank of both jobs refuses within seconds, naming it
    bad = engine_ranks[-1]
    problem = (
        f"refit rank {bad}: {QKV} is {tuple(dst_a.tensors[bad][QKV].shape)} torch.float16, the layout keeps "
        f"{dst_a.tensors[bad][QKV].shape} torch.float32"
    )
    for r, res in [*zip(range(n_trainer), trainer), *zip(engine_ranks, engine)]:
        reason, msg, seconds = res["tensors"]
        assert reason == "tensors" and seconds < 15, (r, seconds, msg)
        if r == bad:
            assert msg.startswith(problem), msg
        else:
            assert msg.startswith(f"refit rank {r}: refit ranks [{bad}] cannot take part") and problem in msg, msg
    for res in engine:
        # B: load_weights got every HF tensor whole, exactly the export hook's (version 2's weights, served as 5)
        assert res["served"] == 5 and res["seen"] == [5]
        assert sorted(res["loaded"]) == sorted(ref2)
        for n, t in res["loaded"].items():
            torch.testing.assert_close(t, ref2[n], rtol=0, atol=0, msg=n)
    for t in trainer:
        assert t["acks1"] == {r: 1 for r in engine_ranks} and t["acks2"] == {r: 2 for r in engine_ranks}
        assert t["acks3"] == {r: 2 for r in engine_ranks}  # refused: still version 2
        assert t["phases6"] == (2 if n_engine > 1 else 1) and t["stats6"].sent_bytes > 0
        assert t["acks5"] == {r: 5 for r in engine_ranks}
        assert t["zero_copy5"] > 0  # helper B sent runs zero-copy
        assert t["plan"][0] == "plan"
        assert t["stats1"].sent_bytes > 0 and t["stats1"].received_bytes == 0


def _tiny_layouts():
    from megatron_ext.sharding import gpt_specs, megatron_layout
    from megatron_ext.weight_export.plan.layout import inference_layout

    specs = gpt_specs(
        num_layers=1,
        hidden_size=8,
        num_heads=2,
        num_groups=1,
        head_dim=4,
        ffn_hidden_size=8,
        vocab_size=16,
        dtype=torch.float32,
    )
    return megatron_layout(specs, ranks=[0]), inference_layout(specs, ranks=[1])


def _in_threads(*fns):
    """Run each fn in its own thread (two refit ranks in this process); return (value or exception) per fn."""
    out = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a refit rank hung"
    return out


def test_missing_peer_fails_within_timeout():
    from megatron_ext import weight_export as wx

    # the engine never joins: the trainer's join fails after the timeout, naming the engine's refit ranks
    start = time.monotonic()
    with pytest.raises(wx.RefitGroupError, match=r"refit ranks \[1, 2\] did not join the refit group"):
        wx.RefitGroup.join("127.0.0.1", free_port(), 0, 3, timeout_s=1.5)
    assert time.monotonic() - start < 10
    # no trainer: the engine cannot reach the store
    with pytest.raises(wx.RefitGroupError, match="could not reach the refit group's store"):
        wx.RefitGroup.join("127.0.0.1", free_port(), 1, 2, timeout_s=1)
    assert time.monotonic() - start < 20
    # both joined, then the engine never calls refit (trainer fails), or the trainer never announces (engine fails)
    src, dst = _tiny_layouts()
    for case in ("engine idle", "trainer idle"):
        port = free_port()

        def trainer():
            group = wx.RefitGroup.join("127.0.0.1", port, 0, 2, timeout_s=1.5)
            refit = wx.TrainerRefit(group, src, dst, {n: torch.zeros(lt.shape) for n, lt in src.tensors[0].items()})
            if case == "engine idle":
                refit.refit(1)
            else:
                time.sleep(3)
            return "idle"

        def engine():
            group = wx.RefitGroup.join("127.0.0.1", port, 1, 2, timeout_s=1.5)
            refit = wx.EngineRefit(group, src, dst)
            if case == "trainer idle":
                refit.refit()
            else:
                time.sleep(3)
            return "idle"

        start = time.monotonic()
        t_out, e_out = _in_threads(trainer, engine)
        assert time.monotonic() - start < 15
        if case == "engine idle":
            assert isinstance(t_out, wx.RefitGroupError), t_out
            assert "refit ranks [1] did not reach the refit within 1.5s" in str(t_out), t_out
        else:
            assert isinstance(e_out, wx.RefitGroupError), e_out
            assert "refit ranks [0] did not announce refit 0 within 1.5s" in str(e_out), e_out


# ----------------------------------------------------------------- a trainer killed mid-refit
# Refit ranks 0, 1: the trainer (TP2; rank 0 hosts the store); 2, 3: the engine (TP1 x DP2; rank 2 atomic,
# rank 3 streaming), threads of this process. The trainer ranks that die run in a process of their own,
# which exits hard (os._exit) after KILL_AFTER rounds of version 2: trainer rank 1 alone (rank 0, in this
# process, then reads the engines' acknowledgements), or the whole trainer job, store included. Every
# engine rank receives from both trainer ranks.
KILL_BUCKET = 512  # many rounds
KILL_AFTER = 3  # rounds of version 2 that a dying trainer rank posts before its process exits
KILLED = 77  # the process's exit code
KILL_TIMEOUT_S = 30


def _kill_layouts():
    from megatron_ext.sharding import gpt_specs, megatron_layout
    from megatron_ext.weight_export.plan.layout import inference_layout

    specs = gpt_specs(
        num_layers=2,
        hidden_size=16,
        num_heads=2,
        num_groups=2,
        head_dim=8,
        ffn_hidden_size=32,
        vocab_size=32,
        dtype=torch.float32,
    )
    return megatron_layout(specs, tp=2, ranks=[0, 1]), inference_layout(specs, tp=1, dp=2, ranks=[2, 3])


def _kill_tensors(src, rank):
    """Trainer rank ``rank``'s version 1 (version 2 is twice that, exactly)."""
    g = torch.Generator().manual_seed(rank)
    return {n: torch.randn(lt.shape, generator=g) for n, lt in src.tensors[rank].items()}


def _trainer_rank(port, rank, *, before_v2=lambda: None):
    """One trainer refit rank: versions 1 and 2 (returns the TrainerRefit and its group)."""
    from megatron_ext import weight_export as wx

    src, dst = _kill_layouts()
    group = wx.RefitGroup.join("127.0.0.1", port, rank, 4, timeout_s=KILL_TIMEOUT_S)
    tensors = _kill_tensors(src, rank)
    refit = wx.TrainerRefit(group, src, dst, tensors, bucket_bytes=KILL_BUCKET, max_inflight=1)
    refit.refit(1)
    before_v2()
    for t in tensors.values():
        t.mul_(2)
    return refit, group


def _trainer_ranks_that_die(port, ranks):
    """Trainer ``ranks`` (threads of this process) serve version 1, then the process exits after KILL_AFTER
    rounds of version 2."""
    from megatron_ext.weight_export.control.refit_group import RefitGroup

    post, posted = RefitGroup.post, {}

    def post_then_die(grp, ops):  # test-only hook, in this process only
        # gloo sends a bucket only once its receiver posted the receive, and an engine posts round k only
        # after it wrote round k - 1 (max_inflight=1): rounds 0 .. KILL_AFTER - 2 are written when this dies
        if posted.setdefault(grp.rank, 0) == KILL_AFTER:
            os._exit(KILLED)
        posted[grp.rank] += 1
        return post(grp, ops)

    def rank_body(r):
        refit, _ = _trainer_rank(port, r, before_v2=lambda: arrived.wait())
        refit.refit(2)

    arrived = threading.Barrier(len(ranks), action=lambda: setattr(RefitGroup, "post", post_then_die))
    threads = [threading.Thread(target=rank_body, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os._exit(1)  # not reached: the hook exits first


@pytest.mark.parametrize("dying", [[1], [0, 1]], ids=["trainer rank 1", "trainer job with the store"])
def test_trainer_killed_mid_refit(dying):
    from megatron_ext import weight_export as wx

    src, dst = _kill_layouts()
    port = free_port()
    child = multiprocessing.get_context("spawn").Process(
        target=_trainer_ranks_that_die, args=(port, dying), daemon=True
    )
    child.start()

    def trainer():  # trainer rank 0, when it survives
        refit, group = _trainer_rank(port, 0)
        acks1 = refit.engine_versions()
        try:
            refit.refit(2)
        except (wx.RefitGroupError, wx.RefitRejected):
            pass  # its own sends may or may not complete: not what this test is about
        acks = refit.engine_versions()
        group.close()
        return acks1, acks

    def engine(rank, atomic):
        group = wx.RefitGroup.join("127.0.0.1", port, rank, 4, timeout_s=KILL_TIMEOUT_S)
        own = {n: torch.full(lt.shape, float("nan")) for n, lt in dst.tensors[rank].items()}
        refit = wx.EngineRefit(group, src, dst, own, bucket_bytes=KILL_BUCKET, max_inflight=1, atomic=atomic)
        stats = refit.refit()
        v1, held1 = {n: t.clone() for n, t in own.items()}, refit.version
        try:
            refit.refit()
            err = None
        except Exception as e:  # noqa: BLE001 - returned to the test, without its traceback: that would
            err = (type(e), str(e))  # keep this rank's gloo pairs open, and trainer rank 0's sends waiting
        group.close()
        return dict(rounds=stats.rounds, v1=v1, held1=held1, after=own, held=refit.version, error=err)

    start = time.monotonic()
    bodies = [lambda: engine(2, True), lambda: engine(3, False)] + ([trainer] if 0 not in dying else [])
    try:
        atomic, streaming, *rest = _in_threads(*bodies)
    finally:
        child.join(KILL_TIMEOUT_S)
        if child.is_alive():
            child.kill()
    assert child.exitcode == KILLED, f"the trainer process exited with {child.exitcode}, not through the test's hook"
    assert time.monotonic() - start < KILL_TIMEOUT_S  # the engine learnt of the death from the connection
    for res in (atomic, streaming):
        assert isinstance(res, dict), res
        assert res["held1"] == 1 and res["rounds"] > 3 * KILL_AFTER
        # the transfer's error, not the store's (a dead store makes the failed refit's acknowledgement fail)
        kind, msg = res["error"]
        assert kind is wx.RefitGroupError and "recv from refit rank" in msg, msg
    # atomic: the previous version bit for bit, and it says so
    assert atomic["held"] == 1
    for n, t in atomic["v1"].items():
        assert torch.equal(atomic["after"][n], t), n
    # streaming: rounds of version 2 were written before the death, so the rank holds no complete version
    assert streaming["held"] is None
    mixed = [n for n, t in streaming["v1"].items() if not torch.equal(streaming["after"][n], t)]
    assert mixed and len(mixed) < len(streaming["v1"]), mixed
    for n in mixed:  # what was written is version 2 (twice version 1) or still version 1
        got, v1 = streaming["after"][n], streaming["v1"][n]
        assert bool(((got == v1) | (got == 2 * v1)).all()), n
    if rest:  # trainer rank 0 survived: the engines acknowledged what they hold
        assert not isinstance(rest[0], BaseException), rest[0]
        assert rest[0] == ({2: 1, 3: 1}, {2: 1, 3: None})


# ----------------------------------------------------------------- the store's listening address
def _non_loopback_ipv4() -> list[str]:
    """This machine's IPv4 addresses other than 127.x (hostname, the default route's source, `ip -4 addr`)."""
    found = set()
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # a UDP connect sends nothing; it picks the outgoing address
            found.add(s.getsockname()[0])
    except OSError:
        pass
    try:
        text = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=5).stdout
        found.update(re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", text))
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(a for a in found if not a.startswith("127.") and a != "0.0.0.0")


def test_store_listens_only_on_the_address_given():
    from megatron_ext import weight_export as wx

    others = _non_loopback_ipv4()
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address to probe the store from")
    port = free_port()
    groups = _in_threads(*(lambda r=r: wx.RefitGroup.join("127.0.0.1", port, r, 2, timeout_s=10) for r in (0, 1)))
    try:
        assert all(isinstance(g, wx.RefitGroup) for g in groups), groups  # a normal join works, and its store
        gathered = _in_threads(*(lambda g=g: g.gather_notes(10 + g.rank, "", what="gather") for g in groups))
        assert gathered == [[(10, ""), (11, "")]] * 2
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        for address in others:
            with pytest.raises(OSError):
                socket.create_connection((address, port), timeout=2).close()
    finally:
        for g in groups:
            if isinstance(g, wx.RefitGroup):
                g.close()


def test_layouts_that_no_source_completes_stop_both_jobs_at_once():
    """Each rank plans only its own transfers, so a tensor the engine keeps and no trainer rank holds is found by
    the engine rank alone; it reports it at the agreement and the trainer rank raises too, within seconds (it
    would otherwise wait for the refit group's timeout)."""
    from megatron_ext import weight_export as wx
    from megatron_ext.sharding import gpt_specs
    from megatron_ext.weight_export.plan.layout import inference_layout

    src, dst = _tiny_layouts()
    model = dict(num_layers=2, hidden_size=8, num_heads=2, num_groups=1, head_dim=4, ffn_hidden_size=8, vocab_size=16)
    more = inference_layout(gpt_specs(**model, dtype=torch.float32), ranks=[1])  # one layer more than the trainer's
    port, start = free_port(), time.monotonic()

    def trainer():
        group = wx.RefitGroup.join("127.0.0.1", port, 0, 2, timeout_s=30)
        return wx.TrainerRefit(group, src, more, {n: torch.zeros(lt.shape) for n, lt in src.tensors[0].items()})

    def engine():
        group = wx.RefitGroup.join("127.0.0.1", port, 1, 2, timeout_s=30)
        return wx.EngineRefit(group, src, more, {n: torch.zeros(lt.shape) for n, lt in more.tensors[1].items()})

    got = _in_threads(trainer, engine)
    assert time.monotonic() - start < 20, "a rank waited for the refit group's timeout"
    for err in got:
        assert isinstance(err, wx.RefitRejected) and err.reason == "tensors", err
    assert "refit rank 1: destination rank 1 keeps model.layers.1." in str(got[1]), got[1]
    assert "no rank of the source layout" in str(got[0]) and "refit ranks [1] cannot take part" in str(got[0]), got[0]
