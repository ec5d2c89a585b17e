"""benchmarks/refit.py --reshard runs end to end on CPU (tiny preset, 4 gloo ranks)."""

import json

import pytest

from benchmarks import refit as bench


def _run(tmp_path, *args):
    out = tmp_path / "rr.json"
    assert bench.main(["--reshard", *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_refit_reshard_benchmark_cpu_smoke(tmp_path):
    result = _run(
        tmp_path,
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--world",
        "4",
        "--iters",
        "1",
        "--limit-gib",
        "0.01",
        "--sweep",
        "1:3:atomic,0.25:2:stream",
        "--no-simulate",
    )
    assert result["same_bytes"] is True  # every setting and both methods give the engine the same bytes
    assert [r["name"] for r in result["rows"]] == [
        "reshard 1MiB m=3 atomic",
        "reshard 0.25MiB m=2 stream",
        "gather-then-broadcast",
        "simulator, measured limit",
    ]
    assert all(r["seconds"] > 0 and r["fraction_of_limit"] > 0 for r in result["rows"])
    assert result["rows"][1]["rounds"] > result["rows"][0]["rounds"]  # smaller buckets: more rounds
    # cross layout: an engine rank holds nothing of the trainer, so everything it keeps crosses a link
    assert result["limit_gbps"] > 0 and result["held_bytes"] == result["link_bytes"] > 0


def test_refit_reshard_benchmark_colocated_cpu(tmp_path):
    """Megatron TP2 -> engine TP1 x DP2 on the same two ranks: each keeps the whole model, half of it local."""
    result = _run(
        tmp_path,
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--world",
        "2",
        "--iters",
        "1",
        "--limit-gib",
        "0.01",
        "--layout",
        "colocated",
        "--no-simulate",
    )
    assert result["same_bytes"] is True and result["layout"] == "colocated"
    assert 0 < result["link_bytes"] < result["held_bytes"]


@pytest.mark.gpus(2)
def test_refit_reshard_benchmark_two_gpus(tmp_path):
    """The largest case 2 GPUs allow: Megatron on GPU 0 -> engine on GPU 1 over NCCL (1B preset)."""
    result = _run(tmp_path, "--preset", "1b", "--device", "cuda", "--world", "2", "--iters", "3", "--no-simulate")
    assert result["same_bytes"] is True
