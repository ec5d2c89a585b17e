"""Reshard refit between a Megatron trainer job and a SEPARATE engine job (own
default worlds, one RefitGroup over a TCP store): the engine's tensors equal the
export hook's HF weights exactly after each version, a mismatched version or plan
is refused with RefitRejected, and a missing peer fails within the timeout
with a message naming it (no hang)."""

import threading
import time

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import free_port, run_on_ranks

from ._reference import hook_reference

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")  # QKV bias: a fused 1-D tensor too
BUCKET = 4096  # small buckets: many rounds


def _specs(n_trainer):
    from megatron_ext.weight_export.layout import specs_from_config

    cfg = tiny_llama.transformer_config(SPEC, tp=n_trainer)
    return specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size,
                             tie_embeddings=SPEC.tie_embeddings)


def _layouts(specs, n_trainer, n_engine):
    """Trainer TP=T at refit ranks 0..T-1; engine A: TP=E (in place), engine B: TP1 x DP=E (load_weights)."""
    from megatron_ext.weight_export.layout import inference_layout, megatron_layout

    engine = range(n_trainer, n_trainer + n_engine)
    return (megatron_layout(specs, tp=n_trainer, ranks=range(n_trainer)),
            inference_layout(specs, tp=n_engine, ranks=engine), inference_layout(specs, tp=1, dp=n_engine, ranks=engine))


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
    tensors = wx.megatron_tensors(model)
    out = {"specs_match": specs == _specs(n_trainer)}
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
    try:  # the engine cuts its buckets differently: refused on every rank before a byte moves
        wx.TrainerRefit(group, src, dst_a, tensors, bucket_bytes=BUCKET)
        out["plan"] = None
    except wx.RefitRejected as e:
        out["plan"] = (e.reason, str(e))
    refit_b = wx.TrainerRefit(group, src, dst_b, tensors, bucket_bytes=BUCKET)  # a second helper on the group
    out["stats5"] = refit_b.refit(5)
    out["acks5"] = refit_b.engine_versions()
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
    refit = wx.EngineRefit(group, src, dst_a, own, bucket_bytes=BUCKET)
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
    try:
        wx.EngineRefit(group, src, dst_a, own, bucket_bytes=2 * BUCKET)
        out["plan"] = None
    except wx.RefitRejected as e:
        out["plan"] = (e.reason, str(e))
    # B: TP1 replicas; after each version the whole HF tensors go to load_weights (as a vLLM worker would)
    loaded = {}
    refit_b = wx.EngineRefit(group, src, dst_b, load_weights=lambda ws: loaded.update(
        {n: t.cpu().clone() for n, t in ws}), bucket_bytes=BUCKET)
    seen = []
    out["served"] = refit_b.serve(on_version=lambda s: seen.append(s.version))
    out["seen"], out["loaded"] = seen, loaded
    group.close()
    return out


def _run_both(backend, n_trainer, n_engine, timeout=240):
    """The trainer job and the engine job, each its own run_on_ranks world, at the same time."""
    port = free_port()
    result = {}

    def engine():
        try:
            result["engine"] = run_on_ranks(_engine_body, n_engine, args=(backend, port, n_trainer), backend=backend,
                                            timeout=timeout, env={"CUDA_VISIBLE_DEVICES": "1"} if backend == "nccl"
                                            else None)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        trainer = run_on_ranks(_trainer_body, n_trainer, args=(backend, port, n_engine), backend=backend,
                               timeout=timeout, env={"CUDA_VISIBLE_DEVICES": "0"} if backend == "nccl" else None)
    finally:
        thread.join()
    if "error" in result:
        raise result["error"]
    return trainer, result["engine"]


def _check(engine, ref, dst, r, label):
    """``engine`` (refit rank ``r``'s local tensors) equals the HF weights cut by the engine layout."""
    for n, lt in dst.tensors[r].items():
        want = torch.cat([ref[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments])
        torch.testing.assert_close(engine[n], want, rtol=0, atol=0, msg=f"{label} refit rank {r} {n}")


@pytest.mark.parametrize("backend,n_trainer,n_engine", [
    ("gloo", 2, 2), pytest.param("nccl", 1, 1, marks=pytest.mark.gpus(2))])
def test_remote_refit_exact(backend, n_trainer, n_engine):
    trainer, engine = _run_both(backend, n_trainer, n_engine)
    src, dst_a, dst_b = _layouts(_specs(n_trainer), n_trainer, n_engine)
    ref1, ref2 = trainer[0]["ref1"], trainer[0]["ref2"]
    assert all(t["specs_match"] for t in trainer)
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
        assert res["version3"] == 2
        for n, t in res["engine3"].items():
            assert torch.equal(t, res["engine2"][n]), n
        # another bucket size: every rank refuses the plan when the helpers are built
        reason, msg = res["plan"]
        assert reason == "plan" and f"refit ranks {engine_ranks}" in msg, msg
        # B: load_weights got every HF tensor whole, exactly the export hook's (version 2's weights, served as 5)
        assert res["served"] == 5 and res["seen"] == [5]
        assert sorted(res["loaded"]) == sorted(ref2)
        for n, t in res["loaded"].items():
            torch.testing.assert_close(t, ref2[n], rtol=0, atol=0, msg=n)
    for t in trainer:
        assert t["acks1"] == {r: 1 for r in engine_ranks} and t["acks2"] == {r: 2 for r in engine_ranks}
        assert t["acks3"] == {r: 2 for r in engine_ranks}  # refused: still version 2
        assert t["acks5"] == {r: 5 for r in engine_ranks}
        assert t["plan"][0] == "plan"
        assert t["stats1"].sent_bytes > 0 and t["stats1"].received_bytes == 0


def _tiny_layouts():
    from megatron_ext.weight_export.layout import gpt_specs, inference_layout, megatron_layout

    specs = gpt_specs(num_layers=1, hidden_size=8, num_heads=2, num_groups=1, head_dim=4, ffn_hidden_size=8,
                      vocab_size=16, dtype=torch.float32)
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
