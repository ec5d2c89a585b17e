"""The engine side of a refit as a command of its own: a Hugging Face model, or megatron-core's engine.

    python -m megatron_ext.weight_export.engine [--model ./hf_model_dir] --address 127.0.0.1:29600 \\
        [--device cuda:1] [--dtype bfloat16] [--sessions 0] [--no-atomic] [--save ./after_refit]
    python -m megatron_ext.weight_export.engine [--model ./hf_model_dir] --refit-store 127.0.0.1:29700 \\
        --refit-rank 2 --refit-world-size 3 [--device cuda:2] [--no-atomic] [--bucket-size-mb 64]
    torchrun --nproc-per-node E -m megatron_ext.weight_export.engine --engine megatron \\
        --refit-store 127.0.0.1:29700 --refit-rank-offset T [--refit-world-size T+E] [--tp N] [--ep N] \\
        [--prompt-tokens 3,17,5 11,2 | --prompts prompts.json] [--generate-tokens 8] [--save-tokens out.json]

``--engine hf`` (the default) loads ``--model`` with
``transformers.AutoModelForCausalLM.from_pretrained`` (a path that is not a directory with a
loadable ``config.json`` is refused at parse time, exit 2) or, without ``--model``, builds the
model from the Hugging Face config the trainer sends with its first plan
(:mod:`.engines.hf_model`: Llama / Qwen2 / Qwen3 / Qwen3-MoE, in the trainer's dtype unless
``--dtype``, weights NaN until the first version writes them), and runs :func:`~.transports.serve.serve`
at ``--address`` for each trainer session (``--sessions``: how many trainers to
serve one after another, 0 = until killed). Point the trainer's ``--refit-target``
at the same address (same host: loopback needs no key; otherwise set
``MEGATRON_EXT_EXPORT_AUTHKEY`` on both sides). It prints one line per applied
version and, when a session ends, the version the model holds; ``--save`` writes
the model (``save_pretrained``) on exit. Exit status: 0 when every session ended
with the trainer's close or departure, 1 on an error (the message says what to do).

With ``--refit-store`` instead of ``--address`` it is one engine rank of the p2p
(reshard) refit (the trainer's ``--refit-transport p2p --refit-store``): it joins
the refit group as refit rank ``--refit-rank`` of ``--refit-world-size`` (the
trainer's ranks come first), takes the trainer's layout and model description
(and, without ``--model``, the model's Hugging Face config) from the trainer, and
receives its whole HF tensors as a TP1 engine replica
(engine ranks = world size - trainer ranks, the trainer's ``--refit-engine-dp``)
straight from the trainer ranks that own them, until the trainer closes.
``--bucket-size-mb``, ``--memory-budget-mb``, ``--zero-copy-mb`` and ``--vocab-padding`` must
be the trainer's (a mismatch is refused on every rank before a byte moves).

``--engine megatron`` serves megatron-core's static inference engine
(:mod:`.megatron_refit`) over the p2p refit: the command is the engine job, one
process per engine rank (``torchrun --nproc-per-node E``, or plain ``python`` for
one rank), engine rank ``r`` is refit rank ``--refit-rank-offset`` (the trainer's
number of ranks) ``+ r``, and ``--tp`` ranks form each replica (``E / --tp``
replicas). An MoE model's experts are split over ``--ep`` of the engine's
ranks (a divisor of ``E``; whole experts per EP rank when ``--ep`` > 1, experts
TP-sharded at ``--ep 1``). It builds its ``GPTModel`` from the config the trainer publishes
(:func:`~.megatron_refit.megatron_trainer_refit`; ``examples/pretrain_gpt.py
--refit-engine megatron``), so the model's flags are not repeated here, and takes
every version in place. After each version it generates ``--generate-tokens``
greedy tokens for every prompt (token ids) and rank 0 prints ``engine: applied
version V in X ms; greedy tokens sha256:H [[...], ...]`` (the hash of the tokens
as JSON; the tokens when there are at most 64), every replica's tokens checked
equal; ``--save-tokens`` writes ``{"V": tokens}`` as JSON after each version. A
model the engine cannot build, or a ``--tp`` / ``--ep`` that is not the
trainer's ``--refit-engine-tp`` / engine EP (``megatron_trainer_refit(engine_ep=)``),
stops every rank of both jobs within seconds, naming the field or flag. It runs
on CUDA GPUs (NCCL); megatron-core's inference calls
``torch.cuda``, so on CPU it runs only under the test-support entry point
``python -m megatron_ext.testing.cpu_engine`` (gloo). Exit status: 0 when the
trainer closed the refit, 1 on an error.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import sys

import torch

from .config import P2P_BUCKET_MB, RefitConfig, memory_budget, parse_address
from .plan.budget import ATOMIC_STAGING
from .control import versions

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINES = ("hf", "megatron")
_HF_ONLY = ("model", "address", "refit_rank", "vocab_padding", "dtype", "sessions", "save")
_MEGATRON_ONLY = ("refit_rank_offset", "tp", "ep", "prompts", "prompt_tokens", "generate_tokens", "save_tokens")
_SHOWN_TOKENS = 64  # a version's line lists the tokens up to this many (the hash always)
_PROGRESS = "static requests"  # megatron-core's StaticInferenceEngine progress bar (tqdm description)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _args(argv, *, megatron_on_cpu: bool = False):
    p = argparse.ArgumentParser(
        prog="python -m megatron_ext.weight_export.engine", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="hf",
        help="hf: a Hugging Face model (--model); megatron: megatron-core's static inference engine built from the "
        "trainer's published config (p2p refit only)",
    )
    p.add_argument(
        "--model",
        help="hf: a Hugging Face model directory (config.json + weights); left out, the model is built from the "
        "config the trainer publishes (weights NaN until the first version)",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="hf: host:port to listen at (only this interface): the export hook's engine")
    where.add_argument("--refit-store", help="host:port of the p2p refit group's store (the trainer's --refit-store)")
    p.add_argument("--refit-rank", type=int, help="hf p2p: this engine's refit rank (trainer ranks come first)")
    p.add_argument(
        "--refit-rank-offset",
        type=int,
        help="megatron: the trainer's number of ranks T; engine rank r is refit rank T + r",
    )
    p.add_argument(
        "--refit-world-size", type=int, help="p2p: trainer ranks + engine ranks (megatron: default T + E, checked)"
    )
    p.add_argument(
        "--tp",
        type=int,
        help="megatron: tensor parallel size of each replica (the trainer's "
        "--refit-engine-tp; default 1); it must divide the engine job's processes",
    )
    p.add_argument("--ep", type=int, help="megatron: expert parallel size of an MoE model (the trainer's engine EP, "
                   "megatron_trainer_refit(engine_ep=); default 1): experts split over this many engine ranks, whole "
                   "when > 1; it must divide the engine job's processes")  # fmt: skip
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompts", help="megatron: a JSON file holding a list of prompts, each a list of token ids")
    prompts.add_argument(
        "--prompt-tokens", nargs="+", help="megatron: prompts as comma-separated token ids, e.g. 3,17,5 11,2"
    )
    p.add_argument("--generate-tokens", type=int, help="megatron: greedy tokens per prompt after each version (8)")
    p.add_argument("--save-tokens", help="megatron: write {version: tokens per prompt} as JSON here after each version")
    p.add_argument("--bucket-size-mb", type=float, default=P2P_BUCKET_MB, help="p2p: the trainer's bucket size")
    p.add_argument(
        "--memory-budget-mb",
        type=memory_budget,
        default="auto",
        help="p2p: the trainer's --refit-memory-budget-mb: auto (default), none, or MiB (the most staging any "
        "rank holds on its device)",
    )
    p.add_argument(
        "--zero-copy-mb",
        type=float,
        default=None,
        help="p2p: the trainer's --refit-zero-copy-mb (default: off, every byte staged)",
    )
    p.add_argument(
        "--atomic-staging",
        choices=ATOMIC_STAGING,
        default="device",
        help="p2p: keep a version until it is applied on the device (default) or in pinned host memory",
    )
    p.add_argument("--vocab-padding", type=int, help="hf p2p: the trainer's --refit-vocab-padding (64)")
    p.add_argument(
        "--device",
        default=None,
        help="where the model lives (default: cuda when there is a GPU, else cpu); megatron: cuda (each rank takes "
        "its LOCAL_RANK's GPU) or cpu",
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="hf: the model's dtype (default auto: its config's)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="how long to wait for a trainer, and for its next message, before giving up",
    )
    p.add_argument("--sessions", type=int, help="hf: trainer sessions to serve one after another (1; 0: forever)")
    p.add_argument(
        "--no-atomic",
        dest="atomic",
        action="store_false",
        help="write buckets as they arrive (no staging memory); an interrupted refit then leaves no "
        "complete version until the next one",
    )
    p.add_argument("--save", default=None, help="hf: save the model here (save_pretrained) on exit")
    args = p.parse_args(argv)
    megatron = args.engine == "megatron"
    wrong = [_flag(d) for d in (_HF_ONLY if megatron else _MEGATRON_ONLY) if getattr(args, d) is not None]
    if wrong:
        p.error(
            f"{', '.join(wrong)} {'goes' if len(wrong) == 1 else 'go'} with --engine "
            f"{'hf' if megatron else 'megatron'}, not --engine {args.engine}"
            + (" (the megatron engine builds the trainer's model and takes its dtype and padding)" if megatron else "")
        )
    try:
        parse_address(args.address or args.refit_store, "--address" if args.address else "--refit-store")
    except ValueError as exc:
        p.error(str(exc))
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        p.error(f"--timeout-s must be > 0 and finite, got {args.timeout_s}")
    if megatron:
        _check_megatron(p, args, megatron_on_cpu)
    else:
        if args.model is not None:
            problem = _model_dir_problem(args.model)
            if problem is not None:  # argparse's error and exit status, in one line (no usage above it)
                p.exit(2, f"{p.prog}: error: {problem}\n")
        args.dtype = args.dtype or "auto"
        args.sessions = 1 if args.sessions is None else args.sessions
        args.vocab_padding = 64 if args.vocab_padding is None else args.vocab_padding
        if args.device is None:
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.refit_store and not (
            isinstance(args.refit_world_size, int)
            and isinstance(args.refit_rank, int)
            and 0 < args.refit_rank < args.refit_world_size
        ):
            p.error(
                "--refit-store needs --refit-rank R and --refit-world-size W with 0 < R < W (refit rank 0 is the "
                f"trainer's first rank), got R={args.refit_rank}, W={args.refit_world_size}"
            )
        if not args.refit_store and (args.refit_rank is not None or args.refit_world_size is not None):
            p.error("--refit-rank / --refit-world-size go with --refit-store (the p2p refit)")
        if args.sessions < 0:
            p.error(f"--sessions must be >= 0 (0: forever), got {args.sessions}")
    args.refit = None  # the p2p refit's config, checked here once
    if args.refit_store:
        try:
            args.refit = RefitConfig(
                transport="p2p",
                store=args.refit_store,
                bucket_size_mb=args.bucket_size_mb,
                memory_budget_mb=args.memory_budget_mb,
                zero_copy_mb=args.zero_copy_mb,
                vocab_padding=64 if megatron else args.vocab_padding,
                atomic=args.atomic,
                atomic_staging=args.atomic_staging,
                timeout_s=args.timeout_s,
            )
        except ValueError as exc:
            text = str(exc).replace("RefitConfig.", "--")
            for field in ("bucket_size_mb", "memory_budget_mb", "zero_copy_mb", "atomic_staging"):
                text = text.replace(field, field.replace("_", "-"))
            p.error(text)
    return args


_MODEL_HINT = (
    "pass a Hugging Face model directory (config.json + weights) or leave --model out to build the model from "
    "the trainer's config"
)


def _model_dir_problem(path: str) -> str | None:
    """Why ``--model path`` is not a Hugging Face model directory (None: its config loads)."""
    if not os.path.exists(path):
        return f"--model {path}: no such directory; {_MODEL_HINT}"
    if not os.path.isdir(path):
        return f"--model {path}: not a directory; {_MODEL_HINT}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"--model {path}: no config.json in it; {_MODEL_HINT}"
    try:
        import transformers
    except ImportError:
        return None  # main() says that transformers is missing
    try:
        transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, said in one line
        return f"--model {path}: its config.json does not load ({_one_line(exc)}); {_MODEL_HINT}"
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _token_lists(value, what: str) -> list[list[int]]:
    """``value`` as prompts (non-empty lists of token ids >= 0); ValueError naming ``what``."""
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(q, list) and q and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in q)
            for q in value
        )
    )
    if not ok:
        raise ValueError(f"{what} must hold a non-empty list of prompts, each a non-empty list of token ids >= 0")
    return value


def _check_megatron(p, args, megatron_on_cpu: bool) -> None:
    """--engine megatron: the flags, the engine job's size (WORLD_SIZE), the prompts; refused at parse."""
    engines = int(os.environ.get("WORLD_SIZE", "1"))
    if args.address:
        p.error("--engine megatron takes its versions over the p2p refit: give --refit-store HOST:PORT, not --address")
    if args.refit_rank_offset is None or args.refit_rank_offset < 1:
        p.error(
            "--engine megatron needs --refit-rank-offset T >= 1, the trainer's number of ranks (engine rank r is "
            f"refit rank T + r), got {args.refit_rank_offset}"
        )
    world = args.refit_rank_offset + engines
    if args.refit_world_size is None:
        args.refit_world_size = world
    elif args.refit_world_size != world:
        p.error(
            f"--refit-world-size {args.refit_world_size} is not --refit-rank-offset {args.refit_rank_offset} + the "
            f"engine job's {engines} process(es) = {world} (torchrun --nproc-per-node); leave it out or fix one"
        )
    args.tp = 1 if args.tp is None else args.tp
    if args.tp < 1 or engines % args.tp:
        p.error(f"--tp {args.tp} must be >= 1 and divide the engine job's {engines} process(es) (WORLD_SIZE)")
    args.ep = 1 if args.ep is None else args.ep
    if args.ep < 1 or engines % args.ep:
        p.error(f"--ep {args.ep} must be >= 1 and divide the engine job's {engines} process(es) (WORLD_SIZE)")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device not in ("cuda", "cpu"):
        p.error(
            f"--engine megatron: --device must be cuda (each rank on its LOCAL_RANK's GPU) or cpu, got {args.device}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    if args.device == "cpu" and not megatron_on_cpu:
        p.error(
            "--engine megatron runs on CUDA GPUs: megatron-core's inference path calls torch.cuda, which a CPU-only "
            "process cannot (CPU runs are test-only: python -m megatron_ext.testing.cpu_engine)"
        )
    try:
        if args.prompts is not None:
            try:
                with open(args.prompts) as f:
                    args.prompt_ids = _token_lists(json.load(f), f"--prompts {args.prompts}")
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"--prompts {args.prompts}: cannot read it as JSON ({exc})") from exc
        elif args.prompt_tokens is not None:
            try:
                ids = [[int(t) for t in q.split(",")] for q in args.prompt_tokens]
            except ValueError:
                ids = None
            args.prompt_ids = _token_lists(ids, "--prompt-tokens (comma-separated token ids per prompt, e.g. 3,17,5)")
        else:
            args.prompt_ids = []
    except ValueError as exc:
        p.error(str(exc))
    if not args.prompt_ids and (args.generate_tokens is not None or args.save_tokens is not None):
        p.error("--generate-tokens / --save-tokens go with --prompts FILE or --prompt-tokens")
    args.generate_tokens = 8 if args.generate_tokens is None else args.generate_tokens
    if args.generate_tokens < 1:
        p.error(f"--generate-tokens must be >= 1, got {args.generate_tokens}")
    args.engines = engines


def main(argv=None, *, megatron_on_cpu: bool = False) -> int:
    """The command; returns its exit status. ``megatron_on_cpu``: the caller installed CPU stand-ins
    for megatron-core's ``torch.cuda`` calls (test support only), so ``--engine megatron`` may run on CPU."""
    args = _args(sys.argv[1:] if argv is None else argv, megatron_on_cpu=megatron_on_cpu)
    logging.basicConfig(level=logging.INFO, format="engine: %(message)s")
    if args.engine == "megatron":
        try:
            _serve_megatron(args)
        except Exception as exc:  # noqa: BLE001 - a command reports and exits
            print(f"engine: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    try:
        import transformers
    except ImportError:
        print("engine: error: transformers is not installed; pip install 'megatron_ext[hf]'", file=sys.stderr)
        return 1
    from .engines.hf_model import HFModelFromTrainer
    from .engines.receiver import HFModelConsumer, WeightReceiver
    from .transports.serve import serve

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device needs an index ("cuda" means cuda:0)
        torch.cuda.set_device(device)
    if args.model is None:  # built at the trainer's first plan, from the config it publishes
        consumer = HFModelFromTrainer(device=device, dtype=None if args.dtype == "auto" else _DTYPES[args.dtype])
    else:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=_DTYPES[args.dtype])
        except Exception as exc:  # noqa: BLE001 - a command reports and exits
            why = f"--model {args.model}: cannot load the model ({_one_line(exc)}); {_MODEL_HINT}"
            print(f"engine: error: {why}", file=sys.stderr, flush=True)
            return 1
        model = model.to(device).eval()
        consumer = HFModelConsumer(model)
    what = args.model or "the trainer's model (built from its config at its first plan)"
    session = 0
    try:
        if args.refit_store:
            _serve_p2p(args, consumer, device)
            return 0
        # One receiver for every session: a new trainer starts from what the model holds
        # (a version, or none after an interrupted in-place refit), not from "initial weights".
        receiver = WeightReceiver(consumer, atomic=args.atomic, device=device)
        while args.sessions == 0 or session < args.sessions:
            session += 1
            print(f"engine: serving {what} at {args.address} on {device} (session {session})", flush=True)
            serve(
                consumer,
                args.address,
                timeout_s=args.timeout_s,
                on_version=lambda v: print(f"engine: applied version {v}", flush=True),
                receiver=receiver,
            )
            fresh = receiver.applied_version is None and receiver.holds_complete_version
            state = "its initial weights" if fresh else versions.describe(receiver.applied_version)
            if consumer.model is None:
                state = "nothing: no model was built (the trainer's plan was refused)"
            elif fresh and args.model is None:
                state = "no version yet (built from the trainer's config: NaN weights)"
            print(f"engine: session {session} ended; the model holds {state}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a command reports and exits
        print(f"engine: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if args.save and consumer.model is None:
            print(f"engine: nothing saved to {args.save}: no model was built", flush=True)
        elif args.save:
            consumer.model.save_pretrained(args.save)
            print(f"engine: saved the model to {args.save}", flush=True)
    return 0


def _serve_p2p(args, consumer, device) -> None:
    """One engine rank of the p2p refit: every announced version, until the trainer closes."""
    from .plan.layout import inference_layout
    from .refit import EngineRefit

    world = args.refit_world_size

    def layout(specs, trainer):  # a TP1 replica on every engine rank, from the trainer's published specs
        first = len(trainer.ranks)
        if first >= world:
            raise ValueError(f"--refit-world-size {world} leaves no engine rank after the trainer's {first} ranks")
        return inference_layout(
            specs, tp=1, dp=world - first, ranks=range(first, world), vocab_padding=args.vocab_padding
        )

    cfg = args.refit
    print(f"engine: joining the refit group at {args.refit_store} as refit rank {args.refit_rank} of {world}")
    group = cfg.join(args.refit_rank, world, device=device)
    try:
        refit = EngineRefit(
            group,
            None,
            layout,
            consumer=consumer,  # without --model: builds its model from the trainer's published config first
            dequantize=True,  # an FP8 refit (the trainer's --refit-quantize fp8-block) loads dequantized
            **cfg.executor_kwargs,
        )
        report = lambda stats: print(f"engine: applied version {stats.version}", flush=True)  # noqa: E731
        held = refit.serve(report, timeout_s=args.timeout_s)
    finally:
        group.close()
    state = versions.describe(held)
    print(f"engine: the trainer closed the refit; the model holds {state}", flush=True)


def _serve_megatron(args) -> None:
    """One rank of the megatron-core engine job: the model from the trainer's published config, every
    announced version in place, greedy tokens after each, until the trainer closes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from .engines.megatron import MegatronEngine
    from .engines.megatron_config import (
        build_engine_model,
        engine_expert_tp,
        megatron_model_problem,
        receive_model_config,
    )
    from .megatron_refit import MegatronEngineRefit, refuse_refit

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    if "RANK" in os.environ:  # torchrun: the engine job's own world
        dist.init_process_group(backend, **kwargs)
    else:  # plain python: a one-rank engine job
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    if dist.get_world_size() != args.engines:
        raise RuntimeError(f"the engine job has {dist.get_world_size()} ranks, WORLD_SIZE said {args.engines}")
    etp = engine_expert_tp(args.tp, args.ep)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep, expert_tensor_parallel_size=etp
    )
    rank = dist.get_rank()
    refit_rank, world = args.refit_rank_offset + rank, args.refit_world_size
    cfg, replicas = args.refit, args.engines // args.tp
    if rank == 0:
        experts = f" (experts: EP{args.ep} x expert TP{etp})" if args.ep > 1 else ""
        print(
            f"engine: megatron-core engine TP{args.tp} x DP{replicas}{experts} on {device.type}: joining the refit "
            f"group at {args.refit_store} as refit ranks {args.refit_rank_offset}..{world - 1} of {world}",
            flush=True,
        )
    group = cfg.join(refit_rank, world, device=device)
    try:
        published = receive_model_config(group, args.timeout_s)
        prompts, n = args.prompt_ids, args.generate_tokens
        try:
            problem = megatron_model_problem(published, args.tp, args.ep) or _engine_problem(args, published)
            if problem is None:
                config = published["config"]
                longest = max((len(q) for q in prompts), default=0)
                engine = MegatronEngine(
                    build_engine_model(published, device=device),
                    max_batch_size=max(1, len(prompts)),  # one static batch: the KV cache holds what it needs
                    max_sequence_length=longest + n if prompts else config["max_sequence_length"],
                )
        except Exception as exc:  # noqa: BLE001 - said on every rank of both jobs, not only here
            problem = f"building the trainer's model failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            refuse_refit(group, f"engine refit rank {refit_rank}: {problem}", **cfg.executor_kwargs)
        refit = MegatronEngineRefit(group, engine, **cfg.executor_kwargs)
        if rank == 0:
            experts = config.get("num_moe_experts")
            moe = f", {experts} experts top-{config['moe_router_topk']} over EP{args.ep}" if experts else ""
            print(
                f"engine: built the trainer's GPTModel ({config['num_layers']} layers, hidden {config['hidden_size']}, "
                f"{config['num_attention_heads']} heads / {config['num_query_groups']} query groups, padded vocabulary "
                f"{config['padded_vocab_size']}, {config['params_dtype']}{moe}); serving every version",
                flush=True,
            )
        saved: dict[str, list[list[int]]] = {}

        def on_version(stats) -> None:
            line = f"engine: applied version {stats.version} in {stats.seconds * 1e3:.1f} ms"
            if prompts:
                tokens = _quiet(engine.generate, prompts, n)  # collective over each replica's TP group
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, tokens)
                odd = [r for r, t in enumerate(everyone) if t != everyone[0]]
                if odd:
                    raise RuntimeError(
                        f"version {stats.version}: engine ranks {odd} generated other tokens than engine rank 0 "
                        f"({everyone[odd[0]]} vs {everyone[0]}): their weights differ"
                    )
                digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
                shown = f" {tokens}" if sum(map(len, tokens)) <= _SHOWN_TOKENS else ""
                line += f"; greedy tokens sha256:{digest}{shown}"
                saved[str(stats.version)] = tokens
                if args.save_tokens and rank == 0:
                    tmp = f"{args.save_tokens}.tmp"
                    with open(tmp, "w") as f:
                        json.dump(saved, f)
                    os.replace(tmp, args.save_tokens)
            if rank == 0:
                print(line, flush=True)

        held = refit.serve(on_version, timeout_s=args.timeout_s)
    finally:
        group.close()
    if rank == 0:
        state = versions.describe(held)
        print(f"engine: the trainer closed the refit; the model holds {state}", flush=True)


def _quiet(fn, *args):
    """``fn(*args)`` without megatron-core's static engine's progress bar (tqdm on stderr, one per batch, which
    nothing turns off once tqdm is imported); whatever else it wrote to stderr is passed on."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            return fn(*args)
    finally:
        rest = "".join(part for part in re.split(r"(?<=[\r\n])", buf.getvalue()) if _PROGRESS not in part)
        if rest.strip():
            sys.stderr.write(rest)


def _engine_problem(args, published) -> str | None:
    """What this command's own flags ask that the trainer's model or refit does not allow (None: nothing)."""
    config, layout = published["config"], published.get("engine", {})
    tp, dp, ep = layout.get("tp"), layout.get("dp"), layout.get("ep", 1)  # format 1: no ep (EP 1)
    if (tp, dp) != (args.tp, args.engines // args.tp):
        return (
            f"--tp {args.tp} on {args.engines} process(es) runs TP{args.tp} x DP{args.engines // args.tp}, but the "
            f"trainer refits an engine of TP{tp} x DP{dp} (its --refit-engine-tp / --refit-engine-dp): start the "
            f"engine with --tp {tp}"
        )
    if ep != args.ep:
        return (
            f"--ep {args.ep}: the trainer refits an engine of EP{ep} (megatron_trainer_refit(engine_ep={ep})): start "
            f"the engine with --ep {ep}"
        )
    vocab, longest = config["padded_vocab_size"], max((len(q) for q in args.prompt_ids), default=0)
    bad = sorted({t for q in args.prompt_ids for t in q if t >= vocab})
    if bad:
        return f"prompt token ids {bad[:5]} (--prompt-tokens / --prompts) are outside the vocabulary 0..{vocab - 1}"
    if args.prompt_ids and longest + args.generate_tokens > config["max_sequence_length"]:
        return (
            f"the longest prompt ({longest} tokens) + --generate-tokens {args.generate_tokens} exceeds the trainer's "
            f"max_sequence_length {config['max_sequence_length']}"
        )
    return None


def exit_now(code: int) -> None:
    """Flush and leave without the interpreter's teardown. Everything is reported and saved by then;
    after a peer died mid-transfer, the destructors of the refit group's backend can wait out its
    timeout on transfers that will never finish."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
