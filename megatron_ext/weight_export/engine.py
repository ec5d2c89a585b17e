"""The engine side of a refit as a command of its own: a Hugging Face model that takes weight exports.

    python -m megatron_ext.weight_export.engine --model ./hf_model_dir --address 127.0.0.1:29600 \\
        [--device cuda:1] [--dtype bfloat16] [--sessions 0] [--no-atomic] [--save ./after_refit]
    python -m megatron_ext.weight_export.engine --model ./hf_model_dir --refit-store 127.0.0.1:29700 \\
        --refit-rank 2 --refit-world-size 3 [--device cuda:2] [--no-atomic] [--bucket-size-mb 64]

It loads ``--model`` with ``transformers.AutoModelForCausalLM.from_pretrained``
and runs :func:`~.transport.serve` at ``--address`` for each trainer session
(``--sessions``: how many trainers to serve one after another, 0 = until
killed). Point the trainer's ``--refit-target`` at the same address
(same host: loopback needs no key; otherwise set ``MEGATRON_EXT_EXPORT_AUTHKEY``
on both sides). It prints one line per applied version and, when a session
ends, the version the model holds; ``--save`` writes the model
(``save_pretrained``) on exit. Exit status: 0 when every session ended with the
trainer's close or departure, 1 on an error (the message says what to do).

With ``--refit-store`` instead of ``--address`` it is one engine rank of the p2p
(reshard) refit (the trainer's ``--refit-transport p2p --refit-store``): it joins
the refit group as refit rank ``--refit-rank`` of ``--refit-world-size`` (the
trainer's ranks come first), takes the trainer's layout and model description
from the trainer, and receives its whole HF tensors as a TP1 engine replica
(engine ranks = world size - trainer ranks, the trainer's ``--refit-engine-dp``)
straight from the trainer ranks that own them, until the trainer closes.
``--bucket-size-mb`` and ``--vocab-padding`` must be the trainer's (a mismatch
is refused on every rank before a byte moves).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from .config import P2P_BUCKET_MB, RefitConfig, parse_address

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.weight_export.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory (config + weights)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="host:port to listen at (only this interface): the export hook's engine")
    where.add_argument("--refit-store", help="host:port of the p2p refit group's store (the trainer's --refit-store)")
    p.add_argument("--refit-rank", type=int, help="p2p: this engine's refit rank (trainer ranks come first)")
    p.add_argument("--refit-world-size", type=int, help="p2p: trainer ranks + engine ranks")
    p.add_argument("--bucket-size-mb", type=float, default=P2P_BUCKET_MB, help="p2p: the trainer's bucket size")
    p.add_argument("--vocab-padding", type=int, default=64, help="p2p: the trainer's --refit-vocab-padding")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model lives (default: cuda when there is a GPU, else cpu)",
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="auto", help="the model's dtype (auto: its config's)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="how long to wait for a trainer, and for its next message, before giving up",
    )
    p.add_argument("--sessions", type=int, default=1, help="trainer sessions to serve one after another (0: forever)")
    p.add_argument(
        "--no-atomic",
        dest="atomic",
        action="store_false",
        help="write buckets as they arrive (no staging memory); an interrupted refit then leaves no "
        "complete version until the next one",
    )
    p.add_argument("--save", default=None, help="save the model here (save_pretrained) on exit")
    args = p.parse_args(argv)
    try:
        parse_address(args.address or args.refit_store, "--address" if args.address else "--refit-store")
    except ValueError as exc:
        p.error(str(exc))
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
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        p.error(f"--timeout-s must be > 0 and finite, got {args.timeout_s}")
    if args.sessions < 0:
        p.error(f"--sessions must be >= 0 (0: forever), got {args.sessions}")
    args.refit = None  # the p2p refit's config, checked here once
    if args.refit_store:
        try:
            args.refit = RefitConfig(
                transport="p2p",
                store=args.refit_store,
                bucket_size_mb=args.bucket_size_mb,
                vocab_padding=args.vocab_padding,
                atomic=args.atomic,
                timeout_s=args.timeout_s,
            )
        except ValueError as exc:
            p.error(str(exc).replace("RefitConfig.", "--").replace("bucket_size_mb", "bucket-size-mb"))
    return args


def main(argv=None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="engine: %(message)s")
    try:
        import transformers
    except ImportError:
        print("engine: error: transformers is not installed; pip install 'megatron_ext[hf]'", file=sys.stderr)
        return 1
    from .receiver import HFModelConsumer
    from .transport import serve

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device needs an index ("cuda" means cuda:0)
        torch.cuda.set_device(device)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=_DTYPES[args.dtype]).to(device)
    model.eval()
    consumer = HFModelConsumer(model)
    session = 0
    try:
        if args.refit_store:
            _serve_p2p(args, consumer, device)
            return 0
        while args.sessions == 0 or session < args.sessions:
            session += 1
            print(f"engine: serving {args.model} at {args.address} on {device} (session {session})", flush=True)
            receiver = serve(
                consumer,
                args.address,
                device=device,
                timeout_s=args.timeout_s,
                atomic=args.atomic,
                on_version=lambda v: print(f"engine: applied version {v}", flush=True),
            )
            state = (
                f"version {receiver.applied_version}"
                if receiver.applied_version is not None
                else "its initial weights"
                if receiver.holds_complete_version
                else "no complete version"
            )
            print(f"engine: session {session} ended; the model holds {state}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a command reports and exits
        print(f"engine: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if args.save:
            model.save_pretrained(args.save)
            print(f"engine: saved the model to {args.save}", flush=True)
    return 0


def _serve_p2p(args, consumer, device) -> None:
    """One engine rank of the p2p refit: every announced version, until the trainer closes."""
    from .layout import inference_layout
    from .remote_refit import EngineRefit

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
            load_weights=consumer.load_weights,
            expected=consumer.expected_tensors(),
            dequantize=True,  # an FP8 refit (the trainer's --refit-quantize fp8-block) loads dequantized
            **cfg.executor_kwargs,
        )
        report = lambda stats: print(f"engine: applied version {stats.version}", flush=True)  # noqa: E731
        held = refit.serve(report, timeout_s=args.timeout_s)
    finally:
        group.close()
    state = f"version {held}" if held is not None else "no complete version"
    print(f"engine: the trainer closed the refit; the model holds {state}", flush=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is reported and saved. Skip the interpreter's teardown: after a peer died mid-transfer, the
    # destructors of the refit group's backend can wait out its timeout on transfers that will never finish.
    os._exit(code)
