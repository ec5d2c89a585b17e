"""benchmarks/refit.py runs end to end on CPU (tiny preset) and writes its JSON."""

import json

from benchmarks import refit as bench  # spawned ranks unpickle its functions by this module name


def test_refit_benchmark_cpu_smoke(tmp_path):
    out = tmp_path / "refit.json"
    assert (
        bench.main(["--preset", "tiny", "--device", "cpu", "--iters", "1", "--limit-gib", "0.02", "--out", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["rows"]]
    # CUDA IPC rows (colocated) run on GPUs only; on CPU the broadcast rows (gloo) run
    assert names == ["cross-gpu ours (broadcast)", "cross-gpu naive (per-tensor broadcast)"]
    ours = [r for r in result["rows"] if r["kind"] == "ours"]
    assert all(abs(r["kl"]) < 1e-3 and r["applied"] == [2] for r in ours), ours
    assert all(r["nbytes"] == ours[0]["nbytes"] > 0 for r in result["rows"])
    assert result["limits"]["copy_gbps"] > 0 and result["limits"]["broadcast_gbps"] > 0
