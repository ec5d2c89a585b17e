"""Reshard refit between real Megatron TP2 ranks (0, 1) and two engine TP1
replicas (2, 3): pipelined rounds give the same bytes at every in-flight depth
with bounded staging; a receiver refuses a source that serves another version
or plan and keeps its previous tensors exactly; a rank whose tensors are not
the layout's is refused on every rank within seconds, before a byte moves; a
NaN in what a trainer rank sends is flagged in its buckets' headers and refused
by that rank and its receivers; the KL gate passes a correct refit and
fails a corrupted one; a fan-out replica that failed its gate cannot pass its
version on. The reference is the export hook's gathered HF weights."""

import re
import time

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

from ._reference import hook_reference, tp_job

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")
BUCKET = 2048  # small buckets: many rounds, transfers cut into rows
DEPTHS = (1, 2, 4)
# --refit-memory-budget-mb in bytes: half of what each rank stages without it (2 peers x 2 rounds x BUCKET), so
# every pair's bucket halves; the least this plan takes is 2048 (a header and the widest row per slot)
BUDGET = 4096
ZERO_COPY = 512  # bytes: contiguous runs of at least this many go from tensor to tensor (zero-copy modes)
# how a receiver stages: atomic on the device, streaming, atomic on the host within the budget, streaming within
# the budget (whose buckets are far below MIN_OP_BYTES: the pairs go in phases, round 0 a header alone per pair);
# and the zero-copy runs taken in place (streaming) or staged (atomic)
MODES = {
    True: dict(atomic=True),
    False: dict(atomic=False),
    "host": dict(atomic=True, atomic_staging="host", memory_budget_bytes=BUDGET),
    "phases": dict(atomic=False, memory_budget_bytes=BUDGET),
    "zero-copy": dict(atomic=False, zero_copy_bytes=ZERO_COPY, max_inflight=64),  # all rounds in round 0's flight
    "zero-copy atomic": dict(atomic=True, zero_copy_bytes=ZERO_COPY),
}
QKV = "model.layers.0.self_attn.qkv_proj.weight"  # an engine tensor
FC2 = "decoder.layers.1.mlp.linear_fc2.weight"  # a trainer tensor (down_proj, TP-split by columns)


def _layouts(cfg):
    from megatron_ext.sharding import megatron_layout, specs_from_config
    from megatron_ext.weight_export.plan.layout import inference_layout

    specs = specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)
    return megatron_layout(specs, tp=2, ranks=[0, 1]), inference_layout(specs, tp=1, dp=2, ranks=[2, 3])


def _body(backend):
    from megatron_ext import weight_export as wx
    from megatron_ext.weight_export.exec import staging
    from megatron_ext.weight_export.plan.reshard_plan import ReshardPlan, build_reshard_plan

    staging.CHECK_CHUNK_BYTES = BUCKET  # the zero-copy NaN/Inf check in many chunks, as on a large model

    rank, device, cfg, model = tp_job(SPEC, backend, tp=2)
    exporter, got = hook_reference(model, SPEC.hf_vocab_size)
    exporter.export()
    src, dst = _layouts(cfg)
    plan = build_reshard_plan(src, dst)
    mine = build_reshard_plan(src, dst, rank=rank)  # this rank's transfers only (slot sizes gathered)
    out = {
        "reference": got if rank == 0 else None,
        "specs_from_model": wx.specs_from_model(model, vocab_size=SPEC.hf_vocab_size) == list(src.specs.values()),
    }
    params = wx.megatron_tensors(model)

    def trainer():  # this rank's trainer tensors, a copy the checks below may change
        return {n: t.clone() for n, t in params.items()} if rank in src.ranks else {}

    def engine():
        return {n: torch.full(lt.shape, float("nan"), device=device) for n, lt in dst.tensors.get(rank, {}).items()}

    def snap(tensors):
        return {n: t.cpu().clone() for n, t in tensors.items()}

    def attempt(fn):
        try:
            fn()
            return None
        except wx.RefitRejected as err:
            return err.reason, str(err), err.stats

    # 1. pipelined rounds: several depths, atomic or applied round by round
    for atomic in (True, False):
        for depth in DEPTHS:
            e = engine()
            ex = wx.ReshardExecutor(
                plan, rank, {**trainer(), **e}, bucket_bytes=BUCKET, atomic=atomic, max_inflight=depth
            )
            stats = ex.refit(1)
            out[("depth", atomic, depth)] = dict(
                engine=snap(e),
                stats=stats,
                send_peers=len(ex.send),
                recv_peers=len(ex.recv),
                recv_buckets=sum(len(b) for b in ex.recv.values()),
                recv_pieces=sum(len(k) for b in ex.recv.values() for k in b),
            )

    # 1a. zero-copy runs: in place (streaming) or staged (atomic), at two depths; each rank with its own plan
    for mode in ("zero-copy", "zero-copy atomic"):
        for depth in (1, 2):
            e = engine()
            kw = MODES[mode] | {"max_inflight": depth}
            ex = wx.ReshardExecutor(mine, rank, {**trainer(), **e}, bucket_bytes=BUCKET, **kw)
            stats = [ex.refit(v) for v in (1, 2)]
            out[("zero_copy", mode, depth)] = dict(engine=snap(e), stats=stats, direct=ex.staging_plan.direct_bytes)

    # 1b. within the memory budget: streaming, and atomic staged on the host; even ranks with their own plan
    # (their peers' slot sizes gathered), odd ranks with the whole plan: every pair cut alike
    for mode in (False, "host"):
        e = engine()
        kw = MODES[mode] | {"memory_budget_bytes": BUDGET}
        ex = wx.ReshardExecutor(plan if rank % 2 else mine, rank, {**trainer(), **e}, bucket_bytes=BUCKET, **kw)
        stats = [ex.refit(v) for v in (1, 2)]  # buffers reused
        out[("budget", mode)] = dict(
            engine=snap(e), stats=stats, host=ex.staging_host_bytes, planned=ex.staging_plan.device_bytes[rank]
        )
    one = dict(bucket_bytes=BUCKET, memory_budget_bytes=BUDGET // 2 - 1, min_op_bytes=None)  # one phase
    ex = wx.ReshardExecutor(plan, rank, {**trainer(), **engine()}, **one)
    out["tiny_budget"] = attempt(lambda: ex.refit(1))
    ex = wx.ReshardExecutor(
        mine, rank, {**trainer(), **engine()}, **one
    )  # the same with each rank's own plan: its peers' slot counts gathered, the same refusal
    out["tiny_budget_rank_plan"] = attempt(lambda: ex.refit(1))

    # 2. a stale source: rank 1 serves version 1 while version 2 is applied ("stale"), or (2b,
    # "late_stale") only in tensors that none of its first buckets carries: a streaming receiver has
    # written round 0 by then and refuses at the end (mixed tensors: no version); an atomic one keeps 1, and so
    # does a streaming one in phases (round 0's header-only bucket vouches for every transfer of its pair)
    def late_only(ex):
        if rank != 1:
            return None

        def first(bs):  # a pair's first round with pieces (in phases round 0 is a header alone)
            return next(k for k, b in enumerate(bs) if b is not None and (ex.phases == 1 or k > 0))

        # what the first buckets' headers vouch for (zero-copy: the pair's zero-copy sources too), and the last
        # bucket with pieces
        early = {t.src_run.local for p, bs in ex.send.items() for t in ex._carried[("send", p, first(bs))]}
        last = [[r for r in b if isinstance(r, list) and r][-1] for b in ex.send.values()]
        late = {t.src_run.local: 1 for b in last for t, _ in b if t.src_run.local not in early}
        assert late, "the test needs a tensor that only a later bucket of rank 1 carries"
        return late

    def faulty_second_version(mode, refit2):
        """Version 1, then ``refit2(ex, trainer tensors)`` tries version 2 (the trainer's weights doubled,
        exact in floating point) with a fault and returns what it raised; then version 3 applies."""
        tr, e = trainer(), engine()
        ex = wx.ReshardExecutor(plan, rank, {**tr, **e}, bucket_bytes=BUCKET, **MODES[mode])
        ex.refit(1)
        before = snap(e)
        for t in tr.values():
            t.mul_(2)
        refused = refit2(ex, tr)
        after, held = snap(e), ex.version
        ex.refit(3)  # every rank stayed in step: the next version applies
        return dict(
            before=before, after=after, held=held, refused=refused, final=snap(e), version=ex.version, phases=ex.phases
        )

    for case, served in (("stale", lambda ex: 1 if rank == 1 else None), ("late_stale", late_only)):
        for atomic in MODES:
            out[(case, atomic)] = faulty_second_version(
                atomic, lambda ex, tr, served=served: attempt(lambda: ex.refit(2, source_version=served(ex)))
            )
    # 3. another plan on rank 0 (every pair's transfers in the other order: other buckets)
    other = ReshardPlan(plan.src, plan.dst, plan.transfers[::-1])
    tr, e = trainer(), engine()
    ex = wx.ReshardExecutor(other if rank == 0 else plan, rank, {**tr, **e}, bucket_bytes=BUCKET)
    out["other_plan"] = dict(refused=attempt(lambda: ex.refit(1)), engine=snap(e), version=ex.version)
    # 3a. the same with each rank's own plan: the two ends of rank 0's pairs do not agree
    other = ReshardPlan(plan.src, plan.dst, mine.transfers[::-1], rank=rank)
    ex = wx.ReshardExecutor(other if rank == 0 else mine, rank, {**tr, **e}, bucket_bytes=BUCKET)
    out["other_rank_plan"] = dict(refused=attempt(lambda: ex.refit(1)), engine=snap(e), version=ex.version)
    # 3b. another bucket size on rank 3 (its buckets would not match on the wire; gloo raised, NCCL undefined)
    ex = wx.ReshardExecutor(plan, rank, {**tr, **e}, bucket_bytes=BUCKET * 2 if rank == 3 else BUCKET)
    out["other_bucket"] = dict(refused=attempt(lambda: ex.refit(1)), engine=snap(e), version=ex.version)
    ex = wx.ReshardExecutor(plan, rank, {**tr, **e}, bucket_bytes=BUCKET)  # the same plan everywhere: it runs
    ex.refit(1)
    out["after_refusal"] = snap(e)
    # 3c. rank 3 runs out of memory for its staging buffers: every rank refuses at once (nobody waits
    # on rank 3's transfers) and nothing is written; with the memory back, the same executor runs
    e = engine()
    ex = wx.ReshardExecutor(plan, rank, {**tr, **e}, bucket_bytes=BUCKET)
    if rank == 3:

        def out_of_memory():
            raise torch.OutOfMemoryError("test: no memory left")

        ex._allocate = out_of_memory
    out["oom"] = dict(refused=attempt(lambda: ex.refit(1)), engine=snap(e))
    if rank == 3:
        del ex._allocate
    ex.refit(2)
    out["after_oom"] = snap(e)
    # 3d. rank 3's engine qkv has another dtype: its executor is built without an error, and the first refit
    # raises RefitRejected("tensors") on every rank at once (rank 3 its problem, the others quoting it)
    e = engine()
    if rank == 3:
        e[QKV] = e[QKV].half()
    start = time.monotonic()
    ex = wx.ReshardExecutor(plan, rank, {**tr, **e}, bucket_bytes=BUCKET)
    out["bad_tensors"] = dict(
        refused=attempt(lambda: ex.refit(1)), seconds=time.monotonic() - start, problem=ex.problem
    )

    # 3e. a NaN in what rank 1 sends for version 2 (its buckets' headers carry the flag); then version 3 applies
    def nan_on_rank1(ex, tr):
        if rank != 1:
            return attempt(lambda: ex.refit(2))
        kept = tr[FC2].view(-1)[3].item()
        tr[FC2].view(-1)[3] = float("nan")
        refused = attempt(lambda: ex.refit(2))
        tr[FC2].view(-1)[3] = kept
        return refused

    def nan_last_on_rank1(ex, tr):
        """The NaN in the last element rank 1 sends: the last piece of its last bucket (the last round)."""
        from megatron_ext.weight_export.plan.reshard_plan import run_view

        if rank != 1:
            return attempt(lambda: ex.refit(2))
        # the last piece of the last round that carries bytes (zero-copy: its last op; the bucket after it is
        # a header alone)
        r = [r for r in max(ex.send.values(), key=len) if r][-1]
        t = r.ops[-1].transfers[-1] if hasattr(r, "ops") else r[-1][0]
        last = run_view(tr[t.src_run.local], t.src_run)
        last = last[-1] if last.dim() > 1 else last
        kept = last[-1].item()
        last[-1] = float("nan")
        refused = attempt(lambda: ex.refit(2))
        last[-1] = kept
        return refused, t.name

    for atomic in MODES:
        out[("nonfinite", atomic)] = faulty_second_version(atomic, nan_on_rank1)
        out[("nonfinite_last", atomic)] = faulty_second_version(atomic, nan_last_on_rank1)
    # 4. the KL gate on each engine replica (an HF model per TP1 replica)
    toks = tiny_llama.tokens(SPEC)
    ref_logits = wx.megatron_logits(model, toks)  # every rank (TP collectives)

    def gate(**kw):
        if rank not in dst.ranks:
            return None
        consumer = wx.HFModelConsumer(tiny_llama.hf_model(SPEC, cfg).to(device))
        return wx.RefitGate(consumer, toks, ref_logits, max_kl=1e-4, **kw)

    def corrupt(tensors):  # rank 1's half of every tensor gets noise
        if rank == 1:
            g = torch.Generator().manual_seed(5)
            for t in tensors.values():
                t.add_(torch.randn(t.shape, generator=g).to(t.device) * t.float().std().clamp_min(0.1))

    tr, e = trainer(), engine()
    ex = wx.ReshardExecutor(plan, rank, {**tr, **e}, bucket_bytes=BUCKET)
    good = ex.refit(1, verify=gate())
    corrupt(tr)
    bad = attempt(lambda: ex.refit(2, verify=gate()))
    bad_version = ex.version
    report = ex.refit(3, verify=gate(on_fail="report"))
    out["gate"] = dict(good=good, bad=bad, bad_version=bad_version, report=report, version=ex.version)
    # 5. fan-out: replica 2 fails its gate in wave 0, so replica 3 refuses it in wave 1 and keeps version 1
    tr, e = trainer(), engine()
    fan = wx.FanoutRefit(src, dst, [[2], [3]], rank, {**tr, **e}, bucket_bytes=BUCKET)
    first = fan.refit(1, verify=gate())
    before = snap(e)
    corrupt(tr)
    refused = attempt(lambda: fan.refit(2, verify=gate()))
    out["fanout"] = dict(first=first, before=before, refused=refused, after=snap(e), version=fan.version)
    return out


def _check(engine, ref, dst, r, label, scale=1.0):
    """``engine`` (rank ``r``'s local tensors) equals the HF weights cut by the engine layout."""
    for n, lt in dst.tensors[r].items():
        want = torch.cat([ref[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments]) * scale
        torch.testing.assert_close(engine[n], want, rtol=0, atol=0, msg=f"{label} rank {r} {n}")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(4))])
def test_reshard_refit_versions_pipelining_and_gate(backend):
    from megatron_ext.weight_export.plan.wire import ALIGN, PAYLOAD_OFFSET
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    results = run_on_ranks(_body, 4, args=(backend,), backend=backend, timeout=300)
    ref = results[0]["reference"]
    src, dst = _layouts(tiny_llama.transformer_config(SPEC, tp=2))
    plan = build_reshard_plan(src, dst)
    assert all(res["specs_from_model"] for res in results)
    # 1. the same bytes at every depth; a receiver gets only what it keeps; staging bounded by the depth
    for atomic in (True, False):
        staging = {}
        for depth in DEPTHS:
            for r in range(4):
                res = results[r][("depth", atomic, depth)]
                s = res["stats"]
                assert s.max_inflight == depth and s.rounds > 2 * max(DEPTHS)
                peers = res["send_peers"] + res["recv_peers"]
                if atomic:  # the whole version on receivers, max_inflight buckets per peer on senders
                    assert s.received_bytes <= s.staging_bytes <= s.received_bytes + depth * peers * BUCKET
                else:
                    assert s.staging_bytes <= depth * peers * BUCKET
                staging[r, depth] = s.staging_bytes
                if r in dst.ranks:
                    _check(res["engine"], ref, dst, r, f"atomic={atomic} depth={depth}")
                    overhead = s.received_bytes - plan.received_bytes()[r]
                    # each bucket: its header padded to ALIGN, and < ALIGN bytes of padding after each piece
                    n, pieces = res["recv_buckets"], res["recv_pieces"]
                    assert PAYLOAD_OFFSET * n <= overhead < PAYLOAD_OFFSET * n + ALIGN * (pieces - n) + 1
                    assert s.local_bytes == 0
        for r in range(4):
            if not atomic or r in src.ranks:
                assert staging[r, 1] < staging[r, 2] < staging[r, 4], (atomic, r, staging)
    # 1a. zero-copy: the same bytes; a sender or streaming receiver stages no more than with every byte staged
    # (here the small runs left still fill its buckets; test_refit_budget shows the drop), an atomic receiver
    # at least what it receives
    for mode in ("zero-copy", "zero-copy atomic"):
        for depth in (1, 2):
            for r in range(4):
                res = results[r][("zero_copy", mode, depth)]
                assert res["direct"][r] > 0, (mode, r)
                staged = results[r][("depth", MODES[mode]["atomic"], depth)]["stats"]
                for s in res["stats"]:
                    if r in dst.ranks and MODES[mode]["atomic"]:
                        assert s.staging_bytes >= s.received_bytes, (mode, depth, r)
                    else:
                        assert s.staging_bytes <= staged.staging_bytes, (mode, depth, r)
                if r in dst.ranks:
                    _check(res["engine"], ref, dst, r, f"{mode} depth={depth}")
    # 1b. within the budget: the same bytes, every rank's device staging at most the budget (what the planner
    # counted), smaller buckets so more rounds; atomic on the host keeps the whole version there
    unbudgeted = {r: results[r][("depth", False, 2)]["stats"] for r in range(4)}
    for mode in (False, "host"):
        for r in range(4):
            res = results[r][("budget", mode)]
            for s in res["stats"]:
                assert s.staging_bytes == res["planned"] <= BUDGET < unbudgeted[r].staging_bytes, (mode, r)
                assert s.rounds > unbudgeted[r].rounds, (mode, r)
            if r in dst.ranks:
                _check(res["engine"], ref, dst, r, f"budget {mode}")
                received = res["stats"][0].received_bytes
                assert (res["host"] >= received > 0) if mode == "host" else res["host"] == 0  # pinned slabs
            else:
                assert res["host"] == 0
    for r in range(4):  # a budget below one row per slot: every rank refuses before anything moves
        reason, msg, _ = results[r]["tiny_budget"]
        assert reason == "staging", msg
        if r == 0:
            assert "cannot stage model.embed_tokens.weight" in msg and "at least 2048 bytes" in msg, msg
        # with its own plan a rank names its own pairs (the whole plan: the job's worst), the least budget counted
        # with its peers' gathered slots
        reason, msg, _ = results[r]["tiny_budget_rank_plan"]
        assert reason == "staging", msg
        if r == 0:
            assert "cannot stage model.embed_tokens.weight" in msg and "at least 2048 bytes" in msg, msg
    # 2. a stale source is refused; the receiver's tensors are exactly the previous version's
    for atomic in MODES:
        for r in range(4):
            res = results[r][("stale", atomic)]
            assert res["version"] == 3
            assert (res["phases"] > 1) == ("memory_budget_bytes" in MODES[atomic]), (atomic, res["phases"])
            if r in src.ranks:
                assert res["refused"] is None
                continue
            reason, msg, _ = res["refused"]
            assert reason == "version" and "rank 1 serves version 1" in msg, msg
            assert res["held"] == 1
            for n in res["before"]:
                assert torch.equal(res["after"][n], res["before"][n]), (atomic, r, n)
            _check(res["before"], ref, dst, r, "version 1")
            _check(res["final"], ref, dst, r, "version 3", scale=2.0)
    # 2b. stale only in a later bucket: atomic keeps version 1 exactly (on the device or the host: the headers
    # are read from the host copies there); streaming wrote round 0, then refused
    for atomic in MODES:
        for r in dst.ranks:
            res = results[r][("late_stale", atomic)]
            reason, msg, _ = res["refused"]
            assert reason == "version" and "rank 1 serves version 1" in msg, msg
            assert res["version"] == 3
            _check(res["final"], ref, dst, r, "version 3", scale=2.0)
            if MODES[atomic]["atomic"] or atomic == "phases":
                assert res["held"] == 1, (atomic, r)
                _check(res["after"], ref, dst, r, "version 1 kept")
            else:
                assert res["held"] is None  # mixed: round 0 of version 2 is written
                assert any(not torch.equal(res["after"][n], res["before"][n]) for n in res["before"])
    # 3. a rank that runs another plan or bucket size: every rank refuses at the first refit, before any
    # byte moves, naming it; nothing written. Then the same plan everywhere runs.
    for case, odd in (("other_plan", 0), ("other_bucket", 3)):
        for r in range(4):
            res = results[r][case]
            reason, msg, _ = res["refused"]
            assert reason == "plan" and f"ranks [{odd}] run another reshard plan or bucket_bytes" in msg, msg
            assert res["version"] is None and all(t.isnan().all() for t in res["engine"].values())
    for r in range(4):
        res = results[r]["other_rank_plan"]
        reason, msg, _ = res["refused"]
        assert reason == "plan" and "the two ends of some pair of ranks planned different transfers" in msg, msg
        assert res["version"] is None and all(t.isnan().all() for t in res["engine"].values())
    for r in range(4):  # wrong tensors on rank 3: every rank refuses at once, naming rank 3 and the problem
        res = results[r]["bad_tensors"]
        reason, msg, _ = res["refused"]
        problem = (
            f"rank 3: {QKV} is {tuple(dst.tensors[3][QKV].shape)} torch.float16, the layout keeps "
            f"{dst.tensors[3][QKV].shape} torch.float32"
        )
        assert reason == "tensors" and res["seconds"] < 15, (res["seconds"], msg)
        if r == 3:
            assert res["problem"].startswith(problem) and msg.startswith(problem), msg
        else:
            assert res["problem"] is None
            assert msg.startswith(f"rank {r}: ranks [3] cannot take part in the refit") and problem in msg, msg
    # a NaN in what rank 1 sends: flagged by the copies that pack it, in its buckets' headers. Rank 1 refuses
    # naming the HF tensor and box, both engines refuse the flagged bucket (atomic: nothing written; streaming:
    # the bad bucket came after round 0, so the rounds written before leave no complete version); rank 0 sent
    # a clean half and is done. Then version 3 applies everywhere
    for atomic in MODES:
        for case in ("nonfinite", "nonfinite_last"):
            sent = results[1][(case, atomic)]["refused"]
            reason, msg, stats = sent if case == "nonfinite" else sent[0]
            # the piece that carried it: rows 0.. of rank 1's columns (the transfer is cut into rows to fit a bucket)
            name = r"model\.layers\.1\.mlp\.down_proj\.weight\[0:\d+, 48:96\]" if case == "nonfinite" else sent[1]
            assert reason == "nonfinite" and re.search("this rank sent a NaN or Inf in " + name, msg), (case, msg)
            assert stats.sent_bytes > 0, "checked as it was packed: the bytes went out"
            assert results[0][(case, atomic)]["refused"] is None, results[0][(case, atomic)]["refused"]
            for r in dst.ranks:
                res = results[r][(case, atomic)]
                reason, msg, _ = res["refused"]
                assert reason == "nonfinite" and "rank 1 sent a NaN or Inf in bucket" in msg, (case, atomic, msg)
                if not MODES[atomic]["atomic"]:
                    assert res["held"] is None and "holds no complete version" in msg, (case, msg)
                else:
                    assert res["held"] == 1, (case, atomic, r)
                    for n in res["before"]:
                        assert torch.equal(res["after"][n], res["before"][n]), (case, atomic, r, n)
                assert res["version"] == 3
                _check(res["final"], ref, dst, r, f"version 3 after a non-finite one ({case})", scale=2.0)
    for r in dst.ranks:
        _check(results[r]["after_refusal"], ref, dst, r, "after a refused plan")
        _check(results[r]["after_oom"], ref, dst, r, "after a staging failure")
    for r in range(4):
        reason, msg, _ = results[r]["oom"]["refused"]
        assert reason == "staging", msg
        assert all(t.isnan().all() for t in results[r]["oom"]["engine"].values())
        if r == 3:  # the rank out of memory says how much and how to need less
            assert "out of device memory for" in msg and "atomic=False stages max_inflight buckets" in msg, msg
        else:
            assert "ranks [3] cannot hold their staging buffers" in msg, msg
    # 4. the gate: a correct refit passes, a corrupted one fails (raise), or is only reported
    for r in dst.ranks:
        g = results[r]["gate"]
        assert g["good"].gate_ok and g["good"].kl < 1e-6 and g["good"].max_logit_diff < 1e-3, g["good"]
        reason, _, stats = g["bad"]
        assert reason == "gate" and stats.kl > 1e-4 and not stats.gate_ok and g["bad_version"] is None
        assert g["report"].gate_ok is False and g["report"].kl > 1e-4 and g["version"] == 3
    for r in src.ranks:
        assert results[r]["gate"]["good"].kl is None  # the gate runs on engine ranks only
    # 5. fan-out: the replica that failed its gate does not pass its version on
    for r in dst.ranks:
        assert all(s.gate_ok for s in results[r]["fanout"]["first"] if s.gate_ok is not None)
    f2, f3 = results[2]["fanout"], results[3]["fanout"]
    assert f2["refused"][0] == "gate" and f2["version"] is None
    assert f3["refused"][0] == "version" and "rank 2 serves no valid version" in f3["refused"][1]
    assert f3["version"] == 1
    for n in f3["before"]:
        assert torch.equal(f3["after"][n], f3["before"][n]), n
    _check(f3["before"], ref, dst, 3, "fan-out version 1")
    assert results[0]["fanout"]["refused"] is None and results[1]["fanout"]["refused"] is None
