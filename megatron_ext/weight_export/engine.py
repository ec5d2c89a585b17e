"""The engine side of a refit as a command of its own: a Hugging Face model that takes weight exports.

    python -m megatron_ext.weight_export.engine --model ./hf_model_dir --address 127.0.0.1:29600 \\
        [--device cuda:1] [--dtype bfloat16] [--sessions 0] [--no-atomic] [--save ./after_refit]

It loads ``--model`` with ``transformers.AutoModelForCausalLM.from_pretrained``
and runs :func:`~.transport.serve` at ``--address`` for each trainer session
(``--sessions``: how many trainers to serve one after another, 0 = until
killed). Point the trainer's ``--refit-target`` at the same address
(same host: loopback needs no key; otherwise set ``MEGATRON_EXT_EXPORT_AUTHKEY``
on both sides). It prints one line per applied version and, when a session
ends, the version the model holds; ``--save`` writes the model
(``save_pretrained``) on exit. Exit status: 0 when every session ended with the
trainer's close or departure, 1 on an error (the message says what to do).
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from .config import parse_address

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.weight_export.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory (config + weights)")
    p.add_argument("--address", required=True, help="host:port to listen at (only this interface)")
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
        parse_address(args.address, "--address")
    except ValueError as exc:
        p.error(str(exc))
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        p.error(f"--timeout-s must be > 0 and finite, got {args.timeout_s}")
    if args.sessions < 0:
        p.error(f"--sessions must be >= 0 (0: forever), got {args.sessions}")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
