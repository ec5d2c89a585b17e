"""benchmarks/refit.py runs end to end on CPU (tiny preset) and writes its JSON."""

import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_refit_benchmark_cpu_smoke(tmp_path):
    # Spawned ranks unpickle the benchmark's functions by module name: import it from sys.path.
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import refit as bench

        out = tmp_path / "refit.json"
        assert (
            bench.main(
                ["--preset", "tiny", "--device", "cpu", "--iters", "1", "--limit-gib", "0.02", "--out", str(out)]
            )
            == 0
        )
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["rows"]]
    # CUDA IPC rows (colocated) run on GPUs only; on CPU the broadcast rows (gloo) run
    assert names == ["cross-gpu ours (broadcast)", "cross-gpu naive (per-tensor broadcast)"]
    ours = [r for r in result["rows"] if r["kind"] == "ours"]
    assert all(abs(r["kl"]) < 1e-3 and r["applied"] == [2] for r in ours), ours
    assert all(r["nbytes"] == ours[0]["nbytes"] > 0 for r in result["rows"])
    assert result["limits"]["copy_gbps"] > 0 and result["limits"]["broadcast_gbps"] > 0
