#!/usr/bin/env bash
# Create .venv with Python 3.12 when it is missing and install megatron_ext
# (editable) with the given extras. A second run reuses the venv and only
# reinstalls when setup.py or constraints.txt changed.
#
#   tools/venv.sh [EXTRAS]        e.g. tools/venv.sh test
#   PYTHON=/path/to/python3.12 tools/venv.sh
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
venv=.venv

is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }

find_python() {
    if [ -n "${PYTHON:-}" ]; then
        if is_py312 "$PYTHON"; then echo "$PYTHON"; return 0; fi
        echo "error: PYTHON=$PYTHON is not a working Python 3.12 (megatron-core 0.19 needs 3.12)." >&2
        return 1
    fi
    local c
    for c in python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12 \
             "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if is_py312 "$c"; then echo "$c"; return 0; fi
    done
    echo "error: no Python 3.12 found (tried python3.12, /usr/bin, /usr/local/bin, ~/.pyenv)." >&2
    echo "       Install Python 3.12 or run with PYTHON=/path/to/python3.12." >&2
    return 1
}

if [ ! -x "$venv/bin/python" ] || ! is_py312 "$venv/bin/python"; then
    py=$(find_python)
    echo "[venv] creating $venv with $py"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
fi

spec="."
[ -n "$extras" ] && spec=".[$extras]"
stamp="$venv/.installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
    if [ ! -d "$venv/lib/python3.12/site-packages/torch" ] && [ "${free_kb:-0}" -lt $((9 * 1024 * 1024)) ]; then
        echo "[venv] warning: $(df -h . | awk 'NR==2 {print $4}') free here; installing torch needs about 9 GB." >&2
    fi
    echo "[venv] installing megatron_ext$( [ -n "$extras" ] && echo "[$extras]") (editable; first run downloads torch, a few minutes)"
    log="$venv/pip-install.log"
    if ! "$venv/bin/python" -m pip install -q -c constraints.txt -e "$spec" >"$log" 2>&1; then
        grep -v "is neither a file nor a directory" "$log" >&2
        echo "error: pip install -e '$spec' into $venv failed (log: $log)." >&2
        if grep -q "No space left on device" "$log"; then
            echo "       The disk is full: $venv needs about 6 GB (torch from PyPI brings its CUDA libraries) and" >&2
            echo "       pip needs about 3 GB more while it downloads. Free space here: $(df -h . | awk 'NR==2 {print $4}')." >&2
            echo "       Free some space (or set TMPDIR to a larger disk), remove $venv and run again." >&2
        fi
        exit 1
    fi
    (cd / && "$OLDPWD/$venv/bin/python" -c "import megatron.core, torch, megatron_ext") >/dev/null 2>&1 \
        || { echo "error: megatron_ext does not import from $venv; remove $venv and run again." >&2; exit 1; }
    touch "$stamp"
fi
