"""The refit simulator on toy cases whose numbers are computed by hand."""

import pytest
import torch

from megatron_ext.sharding import TensorSpec, gpt_specs, megatron_layout
from megatron_ext.weight_export.plan.layout import inference_layout
from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan
from megatron_ext.weight_export.plan.simulate import Links, main, predict, sample_layers

W = [TensorSpec("w", (4, 8), torch.float32, 0, "w", "w")]  # 128 bytes, TP-sharded on rows


def _plan(dst_ranks):
    return build_reshard_plan(megatron_layout(W, tp=1, dp=2), inference_layout(W, tp=2, ranks=dst_ranks))


def test_nic_bound_toy():
    # trainer replicas on node 0 (ranks 0, 1), engine TP2 on node 1 (ranks 2, 3): each engine
    # rank needs 64 bytes; the two replicas serve one each, so every NIC carries 64 bytes.
    links = Links(nic_gbps=64e-9, nvlink_gbps=1.0, gpus_per_node=2, latency_s=0.5)
    p = predict(_plan([2, 3]), links)
    assert p.busiest.endswith("NIC out") or p.busiest.endswith("NIC in")
    assert p.seconds == pytest.approx(1.0 + 0.5)  # 64 B at 64 B/s, plus one bucket's latency
    assert p.lower_bound_s == pytest.approx(1.0)
    assert (p.nic_bytes, p.nvlink_bytes, p.local_bytes, p.max_sent_bytes) == (128, 0, 0, 64)


def test_nvlink_and_colocated_toy():
    links = Links(nic_gbps=1.0, nvlink_gbps=32e-9, gpus_per_node=4, latency_s=1e-9)
    p = predict(_plan([2, 3]), links)  # one node: 64 B per rank over NVLink at 32 B/s
    assert p.seconds == pytest.approx(2.0) and p.lower_bound_s == pytest.approx(2.0)
    p = predict(_plan([0, 1]), Links(hbm_gbps=16e-9, latency_s=1e-9))  # colocated: local copies only
    assert (p.nic_bytes, p.nvlink_bytes, p.local_bytes) == (0, 0, 128)
    assert p.lower_bound_s == 0.0 and p.seconds == pytest.approx(4.0)  # 64 B at 16 B/s per rank


def test_sampled_layers_predict_the_full_model():
    specs = gpt_specs(
        num_layers=4, hidden_size=16, num_heads=4, num_groups=2, head_dim=4, ffn_hidden_size=24, vocab_size=32
    )
    links = Links(gpus_per_node=2)
    full = predict(
        build_reshard_plan(megatron_layout(specs, tp=2, pp=2), inference_layout(specs, tp=2, ranks=[4, 5])), links
    )
    kept, stage, weight = sample_layers(specs, 2)
    assert weight == {0: 2.0, 2: 2.0}
    sampled = predict(
        build_reshard_plan(
            megatron_layout(kept, tp=2, pp=2, layer_stage=stage), inference_layout(kept, tp=2, ranks=[4, 5])
        ),
        links,
        layer_weight=weight,
    )
    assert (sampled.nic_bytes, sampled.max_received_bytes) == (full.nic_bytes, full.max_received_bytes)
    assert sampled.seconds == pytest.approx(full.seconds)


def test_cli_prints_a_row(capsys, tmp_path):
    rows = main(["--config", "qwen3-4b dp8->tp8", "--json", str(tmp_path / "sim.json")])
    assert rows[0]["model_gb"] == pytest.approx(8.05, abs=0.05)  # Qwen3-4B in bf16
    assert "qwen3-4b" in capsys.readouterr().out and (tmp_path / "sim.json").exists()


def test_rank_staging_in_phases_keeps_the_budget_with_larger_buckets():
    """Qwen3-4B, one trainer node (TP1 x DP8) -> 32 TP2 replicas on other nodes, within a 64 MiB budget at 2 in
    flight: the first trainer rank feeds every engine rank, so one phase cuts its buckets to the budget's share
    per peer; the planner's phases give buckets at least twice as large, within the same budget."""
    from megatron_ext.weight_export.plan.simulate import CONFIGS, rank_staging

    model, mk, ek, *_ = CONFIGS["qwen3-4b tp1dp8 -> 32 replicas tp2, separate nodes"]
    specs = gpt_specs(**model)
    src = megatron_layout(specs, **mk)
    dst = inference_layout(specs, **ek, ranks=range(8, 8 + ek["tp"] * ek["dp"]))
    plans = {r: build_reshard_plan(src, dst, rank=r) for r in (0, 8)}
    budget = 64 << 20
    got = rank_staging(
        plans, {0: list(src.ranks), 8: list(dst.ranks)}, budget_bytes=budget, bucket_bytes=64 << 20, max_inflight=2
    )
    trainer = got[0]
    assert trainer["peers"] == 64, trainer  # each engine rank takes an eighth of its share from each trainer rank
    one, phased = trainer["one_phase"], trainer["phases"]
    assert one["phases"] == 1 and one["bucket_mib"] == 0.5, one  # 64 MiB / (2 in flight x 64 peers)
    assert phased["phases"] > 1 and phased["bucket_mib"] >= 2 * one["bucket_mib"], phased
    assert max(one["staging_mib"], phased["staging_mib"]) <= budget / (1 << 20)
