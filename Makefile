# The two commands in the README: `make demo` and `make test` (the import layering contracts of
# .importlinter, then the CPU tests).
# Both create .venv (Python 3.12) when it is missing; PYTHON=... overrides the interpreter.
# The demo streams weights to a Hugging Face model: its venv needs the `hf` extra.
VENV_PY := .venv/bin/python
LINT_IMPORTS := .venv/bin/lint-imports
PYTEST_ARGS ?=

.PHONY: demo test test-gpu clean-venv

demo:
	@tools/venv.sh hf
	OMP_NUM_THREADS=1 $(VENV_PY) examples/demo.py

test:
	@tools/venv.sh test
	$(LINT_IMPORTS) --no-cache --no-logo  # the import layering contracts (.importlinter)
	OMP_NUM_THREADS=1 $(VENV_PY) -m pytest tests/unit_tests $(PYTEST_ARGS)

# GPU tests on a machine that already has torch + CUDA (no venv is made); see README.
test-gpu:
	tools/gpu_tests.sh $(PYTEST_ARGS)

clean-venv:
	rm -rf .venv
