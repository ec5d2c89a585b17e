"""Fixtures for the Python snippets of README.md and docs/*.md (pytest-markdown-docs).

Loaded only by tests/unit_tests/test_docs.py, which runs ``pytest -p
tests.unit_tests.doc_snippets_plugin --markdown-docs README.md docs`` in a subprocess
(the CPU shims below patch ``torch.cuda`` process-wide; the rest of the suite must not
see them). A snippet asks for the objects a training script already has by naming
them in its fence, e.g. ```` ```python fixture:model fixture:config ````; GitHub shows
only ``python``. They are a one-rank gloo job (``parallel_state`` at TP = PP = 1) and a
tiny Llama-shaped megatron-core GPTModel whose shards cover whole 128x128 blocks (so the
FP8 refit snippet runs too), with an HF model of the same shape.
"""

from __future__ import annotations

import os
import warnings

import pytest

from megatron_ext.testing import cpu_compat, tiny_llama

# Head dim 128, FFN 256: every TP1 shard covers whole 128x128 blocks (FP8 refit); two query
# groups, so layouts at TP 2 exist too.
SPEC = tiny_llama.TinyLlamaSpec(
    hidden_size=512, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256, seq_length=8
)


@pytest.fixture(scope="session")
def one_rank_job():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.testing.multirank import free_port

    warnings.filterwarnings("ignore", module=r"(megatron|torch|transformers)(\.|$)")
    cpu_compat.install()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def rank(one_rank_job) -> int:
    """This process's global rank (0: the job has one rank)."""
    return 0


@pytest.fixture
def config(one_rank_job):
    """The model's megatron-core TransformerConfig."""
    return tiny_llama.transformer_config(SPEC)


@pytest.fixture
def model(config):
    """A megatron-core GPTModel (local layer spec, Llama-shaped), built fresh per snippet."""
    return tiny_llama.build_model(SPEC, config)


@pytest.fixture
def ddp_config():
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig()


@pytest.fixture
def ddp(config, ddp_config, model):
    """Megatron's own DistributedDataParallel around ``model``."""
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel(config, ddp_config, model)


@pytest.fixture
def optimizer(ddp):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False, fp16=False), [ddp])


@pytest.fixture
def hf_model(config):
    """A transformers LlamaForCausalLM of the same shape (its own random weights)."""
    return tiny_llama.hf_model(SPEC, config)


@pytest.fixture
def hf_config(hf_model):
    """The HF model's transformers config."""
    return hf_model.config


@pytest.fixture
def hf_vocab() -> int:
    """The HF vocabulary size (Megatron's embedding is padded past it)."""
    return SPEC.hf_vocab_size


@pytest.fixture
def tokens():
    """A batch of token ids, [batch, seq]."""
    return tiny_llama.tokens(SPEC)


@pytest.fixture
def exporter(model, hf_model):
    """A WeightExporter (``inprocess`` into ``hf_model``) that has exported version 1."""
    from megatron_ext.weight_export import HFModelConsumer, RefitConfig, WeightExporter, WeightReceiver

    exp = WeightExporter(
        model,
        RefitConfig(transport="inprocess", vocab_size=SPEC.hf_vocab_size),
        receiver=WeightReceiver(HFModelConsumer(hf_model)),
    )
    exp.export(version=1)
    yield exp
    exp.close()


@pytest.fixture
def call():
    """An engine call for the adapters (records the calls; the engine is not there)."""
    calls = []

    def call(method, *args, **kwargs):
        calls.append(method)

    call.calls = calls
    return call


@pytest.fixture
def checkpoint_dir(tmp_path):
    """An empty directory (megatron-core's dist_checkpointing.save wants one that exists)."""
    return str(tmp_path)
