"""Shared pytest setup: the ``gpus(n)`` marker skips tests on machines with fewer GPUs."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    available = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpus")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        if available < needed:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {needed} CUDA GPU(s), found {available}; run `make test-gpu` on a GPU machine"
                )
            )
