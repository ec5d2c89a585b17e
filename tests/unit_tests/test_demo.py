"""`make demo` (examples/demo.py) runs end to end on CPU: every phase, and its checks pass."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_demo_runs_every_phase_and_passes_its_checks():
    """Runs the demo, or, where ``MEGATRON_EXT_DEMO_LOG`` names the output of a ``make demo`` that
    just succeeded (``.ci/run`` runs it first and stops if it fails), reads that output instead of
    running the same demo twice."""
    log = os.environ.get("MEGATRON_EXT_DEMO_LOG")
    if log:
        stdout = pathlib.Path(log).read_text()
    else:
        out = subprocess.run(
            [sys.executable, str(REPO / "examples" / "demo.py"), "--steps", "4", "--backend", "gloo"],
            capture_output=True,
            text=True,
            timeout=600,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        stdout = out.stdout
    for line in (
        "(decreased)",
        "NTP (failed 0:1) vs uniform loss",
        "weight export: refit",
        "symmetric memory:",
        "reshard refit: 4 gated engine refits",
    ):
        assert line in stdout, line


def _setup_extras() -> dict[str, list[str]]:
    """``extras_require`` of setup.py, read without running it."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def test_make_demo_builds_a_venv_with_what_the_demo_imports_and_ci_runs_it_first():
    """A fresh clone runs `make demo` before anything else: its venv must hold the
    demo's HF receiver (transformers, safetensors), not only what `make test` adds."""
    import re

    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^demo:\n((?:\t.*\n)+)", makefile, re.M)
    assert target, "Makefile has no demo target"
    venv = re.search(r"tools/venv\.sh(?: (\S+))?", target.group(1))
    assert venv, "the demo target does not build the venv"
    extras = _setup_extras()
    installed = {
        req.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
        for extra in (venv.group(1) or "").split(",")
        if extra
        for req in extras[extra]
    }
    assert {"transformers", "safetensors"} <= installed, f"`make demo` installs extras {venv.group(1)!r}: {installed}"
    ci = (REPO / ".ci" / "run").read_text()
    assert "make demo" in ci and "make test" in ci and ci.index("make demo") < ci.index("make test")
