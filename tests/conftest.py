"""Shared pytest setup: the ``gpus(n)`` marker skips tests on machines with fewer GPUs, and
``--min-gpus N`` keeps only the tests marked ``gpus(n)`` with n >= N (the 3-/4-GPU slices of
``tools/multi_gpu_runs.sh`` run just what a smaller machine could not)."""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--min-gpus",
        type=int,
        default=0,
        metavar="N",
        help="deselect every test not marked gpus(n) with n >= N (default 0: keep all)",
    )


def _needed(item):
    marker = item.get_closest_marker("gpus")
    if marker is None:
        return None
    return marker.args[0] if marker.args else 1


def pytest_collection_modifyitems(config, items):
    least = config.getoption("--min-gpus")
    if least > 0:
        keep = [item for item in items if (_needed(item) or 0) >= least]
        dropped = [item for item in items if (_needed(item) or 0) < least]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    available = torch.cuda.device_count()
    for item in items:
        needed = _needed(item)
        if needed is not None and available < needed:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {needed} CUDA GPU(s), found {available}; run `make test-gpu` on a GPU machine"
                )
            )
