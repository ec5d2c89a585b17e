# Sourced by tools/gpu_tests.sh and tools/multi_gpu_runs.sh (with $py set): makes megatron-core
# importable on a GPU machine that lacks it, installing its wheel from .whl/ offline into a private
# target dir, and puts this repository on PYTHONPATH.
if ! "$py" -c 'import megatron.core' >/dev/null 2>&1; then
    shopt -s nullglob
    wheels=(.whl/*.whl)
    [ ${#wheels[@]} -gt 0 ] || { echo "error: megatron-core is not installed and .whl/ has no wheel (see the header of tools/gpu_tests.sh)." >&2; exit 1; }
    site=/tmp/megatron_ext_site
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
