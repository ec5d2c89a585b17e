"""`make demo` (examples/demo.py) runs end to end on CPU: every phase, and its checks pass."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_demo_runs_every_phase_and_passes_its_checks():
    out = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), "--steps", "4", "--backend", "gloo"],
                         capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1",
                                                                         "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for line in ("(decreased)", "NTP (failed 0:1) vs uniform loss", "weight export: refit",
                 "symmetric memory:", "reshard refit: 4 gated engine refits"):
        assert line in out.stdout, line
