"""megatron-core's static-batching inference engine, the engine side of a refit into it.

:class:`MegatronEngine` is megatron-core's static-batching engine
(``StaticInferenceEngine(legacy=True)`` over a ``TextGenerationController`` and a
``GPTInferenceWrapper`` with a ``StaticInferenceContext``: the KV cache is
rewritten from position 0 by every batch). megatron-core's dynamic engine
(``DynamicInferenceEngine``, also what ``StaticInferenceEngine(legacy=False)``
runs) needs CUDA and flash-attn >= 2.7.3 for its paged attention, so it is not
the engine here. The refit that writes into it is :mod:`...megatron_refit`'s
:class:`~...megatron_refit.MegatronEngineRefit`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import torch

from ...sharding.names import unwrap

__all__ = ["MegatronEngine", "TokenIds"]


def _positive_int(where: str, arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {arg} must be an int >= 1, got {value!r}")
    return value


class TokenIds:
    """The tokenizer megatron-core's controller asks for, when prompts are already token ids:
    ``eod`` pads short prompts (and ends a generation only where the sampling params allow it);
    ``detokenize`` spells ids as text."""

    def __init__(self, eod: int = 0, bos: int | None = None):
        self.eod, self.bos = eod, bos

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)


class MegatronEngine:
    """megatron-core's static-batching inference engine over ``model`` (a ``GPTModel`` of
    this rank's TP shard, pipeline size 1, in the engine job's parallel state).

    ``max_batch_size`` prompts run as one batch (more wait for the next one);
    ``max_sequence_length`` (default ``model.max_sequence_length``) bounds prompt + generated
    tokens. ``tokenizer``: megatron-core's tokenizer interface (default :class:`TokenIds`:
    prompts are token ids, ``eod`` 0 pads). :meth:`generate` and :meth:`logits` are collective
    over the engine's TP group (every TP rank passes the same prompts); DP replicas run
    independently, except that an MoE model at EP > 1 dispatches tokens over the expert-parallel
    group, which spans replicas: its replicas must run the same number of forward steps together
    (e.g. the same prompt lengths and ``num_tokens``). megatron-core's ``StaticInferenceEngine``
    marks the process as serving inference (``InferenceMode``) and reseeds torch's global RNG on
    every ``generate``.
    """

    def __init__(self, model, *, max_batch_size: int = 8, max_sequence_length: int | None = None, tokenizer=None):
        from megatron.core import parallel_state as ps
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.engines import StaticInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )

        gpt = unwrap(model)
        if max_sequence_length is None:
            max_sequence_length = getattr(gpt, "max_sequence_length", None)
        _positive_int("MegatronEngine", "max_batch_size", max_batch_size)
        _positive_int("MegatronEngine", "max_sequence_length", max_sequence_length)
        if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() != 1:
            raise ValueError(
                "MegatronEngine runs pipeline size 1 (one stage holds the whole model per TP rank), got "
                f"pipeline_model_parallel_size={ps.get_pipeline_model_parallel_world_size()}"
            )
        self.model = model
        self.vocab_size = gpt.vocab_size  # Megatron's padded rows: what the engine samples over
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.context = StaticInferenceContext(max_batch_size, max_sequence_length)
        self.wrapper = GPTInferenceWrapper(model, self.context)
        self.controller = TextGenerationController(self.wrapper, tokenizer if tokenizer is not None else TokenIds())
        with warnings.catch_warnings():  # "the static engine will be deprecated": its legacy path is the one chosen
            warnings.filterwarnings("ignore", message="The static engine will be deprecated")
            self.engine = StaticInferenceEngine(self.controller, max_batch_size=max_batch_size, legacy=True)
        self.version: int | None = None  # the refit version the weights hold (MegatronEngineRefit sets it)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[Sequence[int]], num_tokens: int, *, sampling_params=None) -> list[list[int]]:
        """The tokens megatron-core generates after each prompt (token ids), one list per prompt.

        Default sampling: greedy (``top_k=1``), exactly ``num_tokens`` tokens (no stop at
        ``eod``). ``sampling_params``: megatron-core's ``SamplingParams`` instead (its
        ``num_tokens_to_generate`` set to ``num_tokens``)."""
        from megatron.core.inference.inference_request import InferenceRequest
        from megatron.core.inference.sampling_params import SamplingParams

        _positive_int("MegatronEngine.generate", "num_tokens", num_tokens)
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts or not all(prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        longest = max(len(p) for p in prompts)
        if longest + num_tokens > self.max_sequence_length:
            raise ValueError(
                f"the longest prompt ({longest} tokens) + num_tokens={num_tokens} exceeds max_sequence_length="
                f"{self.max_sequence_length}"
            )
        bad = sorted({t for p in prompts for t in p if not 0 <= t < self.vocab_size})
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}")
        if sampling_params is None:
            sampling_params = SamplingParams(top_k=1, num_tokens_to_generate=num_tokens)
            sampling_params.add_attributes({"no_early_termination": True})
        else:
            sampling_params = dataclasses.replace(sampling_params, num_tokens_to_generate=num_tokens)
        scheduler = self.engine.scheduler
        requests = [
            InferenceRequest(
                request_id=scheduler.get_new_request_id(), prompt="", prompt_tokens=p, sampling_params=sampling_params
            )
            for p in prompts
        ]
        try:
            done = self.engine.generate(inference_requests=requests)
        finally:  # the scheduler keeps every request it saw: drop this call's
            for r in requests:
                for pool in (scheduler.requests, scheduler.completed_request_pool, scheduler.streams):
                    pool.pop(r.request_id, None)
        return [r.generated_tokens.tolist() for r in done]

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[batch, seq, vocab_size]`` (float32) of ``tokens`` through the
        engine's inference forward (``GPTInferenceWrapper``: one prefill step over the KV cache,
        logits gathered over TP): what :class:`~.gate.RefitGate` compares (``load=False``)."""
        if tokens.dim() != 2 or tokens.shape[0] > self.max_batch_size or tokens.shape[1] > self.max_sequence_length:
            raise ValueError(
                f"tokens must be [batch <= {self.max_batch_size}, seq <= {self.max_sequence_length}], "
                f"got {tuple(tokens.shape)}"
            )
        wrapper, config = self.wrapper, self.context.config
        wrapper.prep_model_for_inference()
        last_only = config.materialize_only_last_token_logits
        config.materialize_only_last_token_logits = False
        try:
            batch = wrapper.prep_inference_input(tokens.to(self.device))
            out = wrapper.run_one_forward_step(wrapper.get_batch_for_context_window(batch, 0, tokens.shape[1]))
        finally:
            config.materialize_only_last_token_logits = last_only
            self.context.reset()
        return out.float()

    def reset(self) -> None:
        """Forget what the engine computed from the previous weights: the static KV cache
        goes back to position 0 in prefill mode (the next batch rewrites it). The parameters
        are written in place, so their storage (and anything captured from it) stays valid."""
        self.context.reset()
