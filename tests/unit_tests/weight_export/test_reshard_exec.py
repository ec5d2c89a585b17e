"""Reshard refit between real Megatron ranks (TP2, TP1 x DP2, TP2 x PP2) and engine ranks in one job:
the engine's local tensors (fused QKV / gate_up per engine TP rank) equal the
HF weights of the same model, exactly, and each receiver gets only the bytes it
keeps. The reference is the model's weights gathered by hand (plain all_gather
over TP, all_gather_object over PP: ``_reference.gathered_hf_state``); the export
hook's output is checked against it too, so a failure says which side is wrong.
Engine tensors are snapshot as copies after their refit (``_reference.snapshot``),
so a snapshot taken too early fails on gloo as it does on NCCL."""

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

from ._reference import gathered_hf_state, hook_reference, snapshot, tp_job

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")  # QKV bias: a fused 1-D tensor too
# name: (trainer ranks, engine layout kwargs)
CASES = {
    "tp2_to_tp1dp2": (dict(tp=2, ranks=[0, 1]), dict(tp=1, dp=2, ranks=[2, 3])),
    "tp2_to_tp2": (dict(tp=2, ranks=[0, 1]), dict(tp=2, ranks=[2, 3])),
    "tp2dp2_to_tp2dp2_colocated": (dict(tp=2, dp=2), dict(tp=2, dp=2)),
}


def _specs(cfg):
    from megatron_ext.sharding import specs_from_config

    return specs_from_config(
        cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size, tie_embeddings=SPEC.tie_embeddings
    )


def _layouts(cfg, case):
    from megatron_ext.sharding import megatron_layout
    from megatron_ext.weight_export.plan.layout import inference_layout

    mk, ek = CASES[case]
    specs = _specs(cfg)
    return megatron_layout(specs, **mk), inference_layout(specs, **ek)


def _body(backend):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.sharding import megatron_layout
    from megatron_ext.weight_export.plan.layout import inference_layout
    from megatron_ext.weight_export.exec.reshard import FanoutRefit, ReshardExecutor, megatron_tensors
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    rank, device, cfg, model = tp_job(SPEC, backend, tp=2)
    # the reference: the model's HF tensors gathered by hand; and the export hook's (gathered to rank 0)
    independent = gathered_hf_state(SPEC, model)  # collective: every rank
    exporter, got = hook_reference(model, SPEC.hf_vocab_size)
    exporter.export()
    out = {"reference": got if rank == 0 else None, "independent": independent if rank == 0 else None}
    params = megatron_tensors(model)
    for case in CASES:
        src, dst = _layouts(cfg, case)
        plan = build_reshard_plan(src, dst)
        tensors = dict(params) if rank in src.ranks else {}
        engine = {n: torch.full(lt.shape, float("nan"), device=device) for n, lt in dst.tensors.get(rank, {}).items()}
        tensors.update(engine)
        ex = ReshardExecutor(plan, rank, tensors, bucket_bytes=4096)  # small buckets: many rounds
        stats = [ex.refit(v) for v in (1, 2)]  # plan and buffers reused
        out[case] = dict(engine=snapshot(engine), stats=stats, rounds=ex.rounds)
    # the refit gate: engine replicas 2 and 3 (TP1) as HF models vs Megatron's logits
    toks = tiny_llama.tokens(SPEC)
    ref_logits = wx.megatron_logits(model, toks)  # every Megatron rank (TP collectives)
    if rank in (2, 3):
        _, dst = _layouts(cfg, "tp2_to_tp1dp2")
        hf = tiny_llama.hf_model(SPEC, cfg)
        consumer = wx.HFModelConsumer(hf)
        before = wx.verify_export(ref_logits, consumer.logits(toks))
        consumer.load_weights(dst.hf_tensors(rank, out["tp2_to_tp1dp2"]["engine"]))
        out["kl"] = (before, wx.verify_export(ref_logits, consumer.logits(toks)))
    # fan-out: engine replica [2] is updated from the trainers, then serves replica [3] with them
    src, dst = _layouts(cfg, "tp2_to_tp1dp2")
    tensors = dict(params) if rank in src.ranks else {}
    engine = {n: torch.full(lt.shape, float("nan"), device=device) for n, lt in dst.tensors.get(rank, {}).items()}
    tensors.update(engine)
    fan = FanoutRefit(src, dst, [[2], [3]], rank, tensors, bucket_bytes=4096)
    stats = fan.refit(7)
    out["fanout"] = dict(engine=snapshot(engine), stats=stats, version=fan.version)
    # TP1 x DP2 (a real TP1 trainer: replicas on ranks 0, 1) -> engine TP2 on ranks 2, 3; tiny_llama
    # builds the same global model at every TP degree, so the TP2 model's export is the reference
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model1 = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC, tp=1), device=device)
    specs = _specs(tiny_llama.transformer_config(SPEC, tp=1))
    plan = build_reshard_plan(
        megatron_layout(specs, tp=1, dp=2, ranks=[0, 1]), inference_layout(specs, tp=2, ranks=[2, 3])
    )
    engine = {n: torch.full(lt.shape, float("nan"), device=device) for n, lt in plan.dst.tensors.get(rank, {}).items()}
    trainer = megatron_tensors(model1) if rank in (0, 1) else {}
    ex = ReshardExecutor(plan, rank, {**trainer, **engine}, bucket_bytes=4096)
    first = ex.refit(1)
    v1 = snapshot(engine)
    with torch.no_grad():  # the next version, written in place (as an optimizer step does): the executor's
        for p in model1.parameters():  # copies are views built at the first refit, so they must see it
            p.mul_(2)
    ex.refit(2)
    out["tp1dp2_to_tp2"] = dict(engine=v1, stats=first, v2=snapshot(engine))
    # TP2 x PP2 -> engine TP2 x DP2 on the same four ranks (stage 1's layers move to ranks 0, 1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    cfg = tiny_llama.transformer_config(SPEC, tp=2, pp=2)
    model = tiny_llama.build_model(SPEC, cfg, device=device)
    # this model's own reference (stage 1 draws its random weights differently from PP1), gathered by
    # hand (independent of the hook and the executor); and the export hook's, checked against it
    independent = gathered_hf_state(SPEC, model)  # collective: every rank
    out["independent_pp2"] = independent if rank == 0 else None
    exporter, got = hook_reference(model, SPEC.hf_vocab_size)
    exporter.export()
    out["reference_pp2"] = got if rank == 0 else None
    specs = _specs(cfg)
    plan = build_reshard_plan(megatron_layout(specs, tp=2, pp=2), inference_layout(specs, tp=2, dp=2))
    engine = {n: torch.full(lt.shape, float("nan"), device=device) for n, lt in plan.dst.tensors[rank].items()}
    ex = ReshardExecutor(plan, rank, {**megatron_tensors(model), **engine}, bucket_bytes=4096)
    stats = [ex.refit(1)]  # before the snapshot (a dict display evaluates its values in order)
    out["tp2pp2"] = dict(engine=snapshot(engine), stats=stats)
    return out


def _mismatches(engine, ref, dst, r, label) -> list[str]:
    """Where ``engine`` (rank ``r``'s local tensors) differs from the HF weights ``ref`` cut by
    the engine layout; says how many elements were never written (still NaN)."""
    out = []
    for n, lt in dst.tensors[r].items():
        want = torch.cat([ref[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments])
        try:
            torch.testing.assert_close(engine[n], want, rtol=0, atol=0)
        except AssertionError as exc:
            nan = int(engine[n].isnan().sum())
            out.append(
                f"{label} rank {r} {n}"
                + (f" ({nan} of {engine[n].numel()} elements still NaN: never written)" if nan else "")
                + f": {exc}"
            )
    return out


def _check(engine, ref, dst, r, label):
    """``engine`` (rank ``r``'s local tensors) equals the HF weights cut by the engine layout."""
    bad = _mismatches(engine, ref, dst, r, label)
    assert not bad, "\n".join(bad)


def _hook_mismatches(hook, ref, label) -> list[str]:
    """Where the export hook's full HF tensors differ from the reference gathered by hand."""
    out = (
        [f"{label}: tensor names differ from the reference: {sorted(set(hook) ^ set(ref))}"]
        if set(hook) != set(ref)
        else []
    )
    for n in sorted(set(hook) & set(ref)):
        try:
            torch.testing.assert_close(hook[n], ref[n], rtol=0, atol=0)
        except AssertionError as exc:
            out.append(f"{label} {n}: {exc}")
    return out


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(4))])
def test_reshard_refit_exact(backend):
    from megatron_ext.weight_export.plan.layout import inference_layout
    from megatron_ext.weight_export.plan.wire import ALIGN, PAYLOAD_OFFSET
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    results = run_on_ranks(_body, 4, args=(backend,), backend=backend, timeout=240)
    ref = results[0]["independent"]
    bad = _hook_mismatches(results[0]["reference"], ref, "tp2 export hook")
    assert not bad, "\n".join(bad)
    cfg = tiny_llama.transformer_config(SPEC, tp=2)
    for case in CASES:
        src, dst = _layouts(cfg, case)
        plan = build_reshard_plan(src, dst)
        for r in dst.ranks:
            res = results[r][case]
            _check(res["engine"], ref, dst, r, case)
            s1, s2 = res["stats"]
            # a receiver gets exactly the bytes it keeps (plus bucket alignment), the same at every refit
            assert s1.received_bytes + s1.local_bytes >= dst.bytes_held(r)
            # on the wire: plus one aligned header per bucket and alignment (< ALIGN bytes per piece; cutting a
            # transfer at a bucket boundary adds at most one piece per bucket)
            overhead = s1.received_bytes - plan.received_bytes().get(r, 0)
            buckets = s1.rounds * len(src.ranks)
            pieces = sum(1 for t in (t for t in plan.transfers if t.dst == r) if t.src != r) + buckets
            assert 0 <= overhead <= PAYLOAD_OFFSET * buckets + (ALIGN - 1) * pieces
            assert (s2.received_bytes, s2.local_bytes) == (s1.received_bytes, s1.local_bytes)
            if case.endswith("colocated"):
                assert s1.received_bytes == 0  # every engine shard is a local copy
            else:
                assert res["rounds"] > 1  # small buckets: several rounds
    for r in (2, 3):
        before, after = results[r]["kl"]
        assert before.kl > 0.01 and after.kl < 1e-6 and after.max_abs_diff < 1e-3, (before, after)
    # fan-out: replica [3] gets the same bytes, served by the updated replica [2] too
    src, dst = _layouts(cfg, "tp2_to_tp1dp2")
    for r in (2, 3):
        _check(results[r]["fanout"]["engine"], ref, dst, r, "fanout")
        assert results[r]["fanout"]["version"] == 7
    wave0, wave1 = results[2]["fanout"]["stats"]
    assert wave0.sent_bytes == 0 and wave1.sent_bytes > 0
    assert results[3]["fanout"]["stats"][0].received_bytes == 0  # replica 3 waits for wave 1
    # TP1 x DP2 -> TP2: exact, and both trainer replicas serve (the work is split by destination)
    dst = inference_layout(_specs(tiny_llama.transformer_config(SPEC, tp=1)), tp=2, ranks=[2, 3])
    for r in (2, 3):
        _check(results[r]["tp1dp2_to_tp2"]["engine"], ref, dst, r, "tp1dp2_to_tp2")
        _check(results[r]["tp1dp2_to_tp2"]["v2"], {n: 2 * t for n, t in ref.items()}, dst, r, "tp1dp2_to_tp2 v2")
    assert all(results[r]["tp1dp2_to_tp2"]["stats"].sent_bytes > 0 for r in (0, 1))
    # TP2 x PP2 -> TP2 x DP2 (the same global model at every layout): the reshard engine and the export
    # hook each against the reference gathered by hand; every mismatch of both sides is reported at once
    ref_pp2 = results[0]["independent_pp2"]
    dst = inference_layout(_specs(tiny_llama.transformer_config(SPEC, tp=2, pp=2)), tp=2, dp=2)
    bad = [
        m
        for r in range(4)
        for m in _mismatches(results[r]["tp2pp2"]["engine"], ref_pp2, dst, r, "tp2pp2 reshard engine")
    ]
    bad += _hook_mismatches(results[0]["reference_pp2"], ref_pp2, "tp2pp2 export hook")
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad)
    assert results[0]["tp2pp2"]["stats"][0].received_bytes > 0  # stage 1's layers arrive from ranks 2, 3
