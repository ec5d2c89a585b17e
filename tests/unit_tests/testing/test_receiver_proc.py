"""A receiver process started by our code that dies is reported within seconds,
with its own error (exit code and traceback), not after the trainer's connect
timeout as "no receiver listening"."""

import sys
import time

import pytest

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import RankFailure, run_on_ranks
from megatron_ext.testing.receiver_proc import start_hf_receiver

SPEC = tiny_llama.TinyLlamaSpec()
CONNECT_TIMEOUT_S = 120.0  # the export's default: what the trainer waited before


def _build_without_transformers(spec):
    """``tiny_llama.build_hf`` in a venv without the ``hf`` extra."""
    sys.modules["transformers"] = None  # `import transformers` now raises ModuleNotFoundError
    return tiny_llama.build_hf(spec)


def _export_to(address):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel()
    model = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC))
    exporter = wx.WeightExporter(
        model,
        wx.RefitConfig(
            target=address, transport="broadcast", vocab_size=SPEC.hf_vocab_size, timeout_s=CONNECT_TIMEOUT_S
        ),
    )
    exporter.export()


def test_receiver_that_dies_at_start_is_reported_with_its_error():
    start = time.monotonic()
    with start_hf_receiver(_build_without_transformers, (SPEC,)) as receiver:
        with pytest.raises(RankFailure) as info:
            run_on_ranks(
                _export_to,
                1,
                args=(receiver.address,),
                backend="gloo",
                timeout=2 * CONNECT_TIMEOUT_S,
                watch=receiver.failure,
            )
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert elapsed < CONNECT_TIMEOUT_S / 4, f"took {elapsed:.0f}s to report the dead receiver"
    assert f"the HF receiver process for {receiver.address} exited with code 1" in msg, msg
    assert "ModuleNotFoundError" in msg and "transformers" in msg, msg
    assert "no receiver listening" not in msg, msg
