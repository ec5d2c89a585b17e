"""benchmarks/refit.py --reshard runs end to end on CPU (tiny preset, 4 gloo ranks)."""

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_refit_reshard_benchmark_cpu_smoke(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import refit as bench

        out = tmp_path / "rr.json"
        assert bench.main(["--reshard", "--preset", "tiny", "--device", "cpu", "--world", "4", "--iters", "1",
                           "--limit-gib", "0.01", "--bucket-size-mb", "1", "--max-inflight", "3", "--no-simulate",
                           "--out", str(out)]) == 0
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    result = json.loads(out.read_text())
    assert result["same_bytes"] is True  # both methods give the engine the same bytes
    assert result["max_inflight"] == 3
    assert [r["name"] for r in result["rows"]] == ["reshard (p2p, own shards only)", "gather-then-broadcast",
                                                   "simulator, measured limit"]
    assert all(r["seconds"] > 0 and r["fraction_of_limit"] > 0 for r in result["rows"])
    assert result["limit_gbps"] > 0 and result["held_bytes"] > 0


@pytest.mark.gpus(2)
def test_refit_reshard_benchmark_two_gpus(tmp_path):
    """The largest case 2 GPUs allow: Megatron on GPU 0 -> engine on GPU 1 over NCCL (1B preset)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import refit as bench

        out = tmp_path / "rr.json"
        assert bench.main(["--reshard", "--preset", "1b", "--device", "cuda", "--world", "2", "--iters", "3",
                           "--no-simulate", "--out", str(out)]) == 0
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    result = json.loads(out.read_text())
    assert result["same_bytes"] is True
