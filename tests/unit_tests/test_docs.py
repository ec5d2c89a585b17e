"""Every Python snippet of README.md and docs/*.md runs on CPU (pytest-markdown-docs).

A documented name that is renamed or removed fails here, naming the Markdown file and
line. The snippets run in their own pytest process: their fixtures
(tests/unit_tests/doc_snippets_plugin.py) install the CPU shims for megatron-core and a
one-rank gloo job, which must not leak into the rest of the suite. Fence options:
``fixture:NAME`` hands a snippet an object of the plugin (a model, its config, ...),
``continuation`` runs it after the block before it, ``notest`` skips it (each such block
says why in the text around it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs"]


def test_doc_snippets_run():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.unit_tests.doc_snippets_plugin", "--markdown-docs"]
    cmd += ["-p", "no:cacheprovider", "-q", *DOCS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"documentation snippets failed ({' '.join(cmd[2:])}):\n{out[-20000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 20, f"too few snippets ran:\n{out[-5000:]}"
