"""benchmarks/plan_at_scale.py on CPU: both planners plan the same job (each timed rank receives the same bytes
from either plan), a job whose megatron-core metadata misses a tensor is refused, and bad flags are refused by
name."""

import json

import pytest

from benchmarks import plan_at_scale as bench


def test_both_planners_plan_the_same_job_and_the_json_says_how(tmp_path):
    out = tmp_path / "plan.json"
    results = bench.main(["--worlds", "4,8", "--repeats", "1", "--out", str(out)])
    assert [r["world"] for r in results] == [4, 8]
    for res in results:
        assert [row["side"] for row in res["rows"]] == ["trainer", "engine"]
        for row in res["rows"]:
            assert row["received_bytes"] > 0 and row["ours_transfers"] > 0 and row["mcore_ops"] > 0
            assert row["mcore_total_s"] >= row["mcore_plan_s"] > 0 and row["ours_plan_s"] > 0
        # a colocated engine rank of Qwen3-4B at TP1 keeps the whole model (tied embeddings: no output layer)
        assert res["rows"][1]["received_bytes"] == pytest.approx(8.04e9, rel=0.01)
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python benchmarks/plan_at_scale.py --worlds 4,8")
    assert saved["machine"]["cpus"] >= 1 and saved["results"][1]["ranks"] == 8


def test_metadata_that_misses_a_tensor_is_not_the_same_job(monkeypatch):
    real = bench._metadata

    def without_a_norm(layout, full, groups, rank, cache):
        return [m for m in real(layout, full, groups, rank, cache) if m.name != "decoder.final_layernorm.weight"]

    monkeypatch.setattr(bench, "_metadata", without_a_norm)
    with pytest.raises(SystemExit, match="not one job"):
        bench.main(["--worlds", "4", "--repeats", "1"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worlds", "4,x"], "--worlds takes comma-separated integers"),
        (["--worlds", "0"], "--worlds takes positive integers"),
        (["--worlds", "6"], "--worlds: 6 is not a multiple"),
    ],
)
def test_bad_worlds_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
