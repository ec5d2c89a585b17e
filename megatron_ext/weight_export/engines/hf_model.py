"""A Hugging Face engine's model built from the config the trainer publishes, so that trying a refit
needs no checkpoint on disk (the engine command without ``--model``).

Trainer side (the export hook's remote senders send it with the plan; :meth:`~..refit.TrainerRefit.from_model`
publishes it with its layout)::

    published = hf_model_config(model, vocab_size=hf_vocab)
    # {"format": 1, "model_type": "llama", "dtype": "bfloat16", "config": {transformers' to_dict()}}
    # or {"format": 1, "error": "why the model has no Hugging Face form"}

Engine side::

    consumer = HFModelFromTrainer(device="cuda")   # no model yet
    consumer.configure(published)                  # serve() / EngineRefit call it before the plan check
    consumer.model                                 # transformers' *ForCausalLM; weights NaN until a refit writes them

The config is :func:`~megatron_ext.sharding.hf_config_from_megatron` of the trainer's ``TransformerConfig``:
Llama, Qwen2 (QKV bias), Qwen3 (qk-layernorm) or Qwen3-MoE (experts), plain JSON (nothing pickled), rebuilt
on the engine by ``transformers``' own ``from_dict`` of an allowed ``model_type``.
"""

from __future__ import annotations

import json

import torch

from ...sharding.hf_config import hf_config_from_megatron
from ...sharding.names import unwrap
from ..plan.errors import PlanMismatch
from .receiver import HFModelConsumer

__all__ = ["HF_CONFIG_FORMAT", "HFModelFromTrainer", "build_hf_model", "hf_model_config"]

HF_CONFIG_FORMAT = 1
"""The format of :func:`hf_model_config`; an engine refuses another, naming both."""

_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")  # the model_types an engine builds
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NOTE = 1000  # the longest error text the trainer publishes
_PASS_MODEL = "start the engine with --model DIR (a Hugging Face model of the trainer's shape)"


def _llama_shape_problem(gpt, c) -> str | None:
    """Why ``gpt`` (config ``c``) is not a Llama / Qwen-shaped model that a ``transformers`` config describes."""
    act = getattr(c.activation_func, "__name__", repr(c.activation_func))
    checks = [
        ("position_embedding_type", getattr(gpt, "position_embedding_type", None), "rope"),
        ("normalization", c.normalization, "RMSNorm"),
        ("gated_linear_unit", c.gated_linear_unit, True),
        ("activation_func", act, "silu"),
        ("add_bias_linear", c.add_bias_linear, False),
        ("layernorm_zero_centered_gamma", c.layernorm_zero_centered_gamma, False),
        ("apply_residual_connection_post_layernorm", c.apply_residual_connection_post_layernorm, False),
        ("rotary_interleaved", c.rotary_interleaved, False),
        ("rotary_percent", getattr(gpt, "rotary_percent", 1.0), 1.0),
        ("softmax_scale", c.softmax_scale, None),
        ("multi_latent_attention", getattr(c, "multi_latent_attention", False), False),
    ]
    for name, value, want in checks:
        if value != want:
            return (
                f"{name}={value!r}: a Hugging Face model built from the trainer's config is Llama / Qwen-shaped, "
                f"with {name}={want!r}"
            )
    if c.num_moe_experts and not c.qk_layernorm:
        return "an MoE model is built as Qwen3-MoE, which normalises queries and keys: the trainer needs qk_layernorm"
    if c.qk_layernorm and c.add_qkv_bias and not c.num_moe_experts:
        return "qk_layernorm with add_qkv_bias: no Llama / Qwen2 / Qwen3 model has both"
    return None


def _rotary_base(gpt, c) -> float:
    """The trainer's RoPE base, checked against the frequencies its model runs (rope scaling changes them)."""
    base = float(getattr(gpt, "rotary_base", 10000))
    inv_freq = getattr(getattr(gpt, "rotary_pos_emb", None), "inv_freq", None)
    if inv_freq is not None:
        dim = c.kv_channels or c.hidden_size // c.num_attention_heads
        want = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        got = inv_freq.detach().float().cpu()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6, atol=0):
            raise ValueError(
                f"the trainer's rotary frequencies are not those of rotary_base={base:g} (rope scaling or "
                "seq_len_interpolation_factor?): no plain Llama / Qwen rope describes them"
            )
    return base


def hf_model_config(model, *, vocab_size: int) -> dict:
    """``model`` (a Megatron ``GPTModel``, possibly inside DDP / ``Float16Module``) as the ``transformers``
    config an engine builds its model from, plain JSON: ``{"format", "model_type", "dtype", "config"}``
    (``config``: ``to_dict()`` of :func:`~megatron_ext.sharding.hf_config_from_megatron`; ``vocab_size``: the
    HF vocabulary, the rows the refit sends). Never raises: a model with no such form (LayerNorm, biases,
    learned positions, rope scaling, ...) or a trainer without ``transformers`` gives ``{"format", "error"}``,
    which an engine without a model of its own quotes."""
    try:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be the HF vocabulary (an integer >= 1), got {vocab_size!r}")
        gpt = unwrap(model)
        c = gpt.config
        problem = _llama_shape_problem(gpt, c)
        if problem is not None:
            raise ValueError(problem)
        moe, qwen3, qwen2 = bool(c.num_moe_experts), bool(c.qk_layernorm), bool(c.add_qkv_bias)
        arch = "qwen3_moe" if moe else "qwen3" if qwen3 else "qwen2" if qwen2 else "llama"
        try:
            hf = hf_config_from_megatron(
                c,
                arch=arch,
                vocab_size=vocab_size,
                max_position_embeddings=gpt.max_sequence_length,
                rope_theta=_rotary_base(gpt, c),
                tie_word_embeddings=bool(gpt.share_embeddings_and_output_weights),
            )
        except ImportError:
            raise ValueError(
                "transformers is not installed in the trainer (pip install 'megatron_ext[hf]' there), so it cannot "
                "describe its model in Hugging Face terms"
            ) from None
        dtype = next(gpt.parameters()).dtype
        return {
            "format": HF_CONFIG_FORMAT,
            "model_type": hf.model_type,
            "dtype": str(dtype).removeprefix("torch."),
            "config": json.loads(hf.to_json_string()),
        }
    except Exception as exc:  # noqa: BLE001 - published for the engine to quote, never fatal for the trainer
        return {"format": HF_CONFIG_FORMAT, "error": f"{type(exc).__name__}: {exc}"[:_NOTE]}


def hf_config_problem(published) -> str | None:
    """Why an engine cannot build a model from ``published`` (None: it can). No ``transformers`` import."""
    if published is None:
        return (
            "the trainer sent no Hugging Face config of its model (a trainer of an older megatron_ext, or a "
            f"TrainerRefit built without hf_config=): {_PASS_MODEL}"
        )
    if not isinstance(published, dict) or published.get("format") != HF_CONFIG_FORMAT:
        got = published.get("format") if isinstance(published, dict) else str(published)[:100]
        return (
            f"the trainer's Hugging Face config is in format {got}, this engine reads format {HF_CONFIG_FORMAT}: run "
            "the same megatron_ext release on both sides"
        )
    if "error" in published:
        return f"the trainer's model has no Hugging Face config ({published['error']}): {_PASS_MODEL}"
    if published.get("model_type") not in _ARCHS or published.get("dtype") not in _DTYPES:
        return (
            f"the trainer's Hugging Face config is model_type={published.get('model_type')!r}, "
            f"dtype={published.get('dtype')!r}: this engine builds model_type {list(_ARCHS)} in {list(_DTYPES)}"
        )
    if not isinstance(published.get("config"), dict):
        return "the trainer's Hugging Face config has no 'config' object"
    return None


def build_hf_model(published: dict, *, device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The ``transformers`` model of the trainer's published config (:func:`hf_model_config`) on ``device``,
    in ``dtype`` (None: the trainer's), in eval mode. Its parameters are NaN until a refit writes them, so a
    weight that no refit writes shows in the engine's output. Raises ValueError naming what it cannot build."""
    problem = hf_config_problem(published)
    if problem is not None:
        raise ValueError(problem)
    import transformers

    config = transformers.CONFIG_MAPPING[published["model_type"]].from_dict(published["config"])
    dtype = _DTYPES[published["dtype"]] if dtype is None else dtype
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_kw: dtype})
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return model.eval()


def _difference(a: dict, b: dict) -> str | None:
    """The first field in which two published configs differ (None: the same model)."""
    for key in ("model_type", "dtype"):
        if a.get(key) != b.get(key):
            return f"{key} {a.get(key)!r} vs {b.get(key)!r}"
    ca, cb = a["config"], b["config"]
    for key in sorted((set(ca) | set(cb)) - {"transformers_version"}):
        if ca.get(key) != cb.get(key):
            return f"{key} {ca.get(key)!r} vs {cb.get(key)!r}"
    return None


class HFModelFromTrainer:
    """The consumer of an engine started without a model: :meth:`configure` (which
    :func:`~..transports.serve.serve` and :class:`~..refit.EngineRefit` call with the config the trainer
    publishes, before the plan check) builds the ``transformers`` model (:func:`build_hf_model`) on ``device``
    in ``dtype`` (None: the trainer's); from then on it is an :class:`~.receiver.HFModelConsumer` of
    :attr:`model`. A later trainer of another model is refused (:class:`~..plan.errors.PlanMismatch`, naming
    the first field that differs): the engine's model and the version it holds stay as they are."""

    def __init__(self, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.device, self.dtype = torch.device(device), dtype
        self.model: torch.nn.Module | None = None
        self.published: dict | None = None
        self._consumer: HFModelConsumer | None = None

    def configure(self, published) -> None:
        if self._consumer is not None:
            problem = hf_config_problem(published)
            diff = problem or _difference(self.published, published)
            if diff is not None:
                raise PlanMismatch(
                    f"this engine built its model from an earlier trainer's config, and this trainer's model differs "
                    f"({diff}): restart the engine to serve it"
                )
            return
        try:
            model = build_hf_model(published, device=self.device, dtype=self.dtype)
        except ValueError as exc:
            raise PlanMismatch(str(exc)) from None
        self.model, self.published, self._consumer = model, published, HFModelConsumer(model)

    def _built(self) -> HFModelConsumer:
        if self._consumer is None:
            raise PlanMismatch("the engine has no model yet: it builds it from the trainer's config at the first plan")
        return self._consumer

    def expected_tensors(self):
        return self._built().expected_tensors()

    def load_weights(self, weights) -> None:
        self._built().load_weights(weights)

    def target(self, name: str) -> torch.Tensor:
        return self._built().target(name)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._built().logits(tokens)
