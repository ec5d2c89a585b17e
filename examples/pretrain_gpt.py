"""Pretrain a megatron-core GPT, with megatron_ext's capabilities switched on by flags.

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 \\
        --vocab-size 128 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 \\
        --lr 1e-3 --tensor-model-parallel-size 2 [plugin flags]

Built on megatron-core only (Megatron-LM's ``megatron.training`` is not a pip
package), with Megatron-LM's flag names and semantics: ``get_forward_backward_func``
runs the micro-batches, ``get_megatron_optimizer`` and ``OptimizerParamScheduler``
step, ``dist_checkpointing`` saves and loads model + optimizer, and
``MockGPTDataset`` (megatron.core.datasets) feeds synthetic tokens. The plugin's
flag groups switch its capabilities on:

- ``--ntp-tp-base N --ntp-failed-slots R:S``: nonuniform tensor parallelism
  (launch the healthy GPUs only; ``--ntp-balance tp`` gives each replica a share
  of every global batch by its TP degree, ``--ntp-balance measured`` by its throughput
  measured over the first ``--ntp-balance-measure-steps`` iterations). Each degraded replica trains as the
  satellite of a healthy partner replica (its gradients join the partner's buckets, the updated weights come
  back, in units of ``--ntp-transfer-chunk-mb``); the healthy replicas are a uniform ``tp_base`` job, and an NTP
  job's checkpoint is theirs: a uniform ``tp_base`` checkpoint. A uniform job resumes it and an NTP job resumes
  a uniform one's, with no conversion (any TP degree; with --use-distributed-optimizer at the TP degree that
  saved it, ``tp_base`` for an NTP job).
- ``--symm-mem {auto,on,off}``: the DDP buckets staged in NCCL symmetric memory
  (default auto; gloo/CPU falls back to plain buffers and says so).
- ``--refit-target HOST:PORT --refit-transport broadcast`` (aliases
  ``--weight-export-*``): the weights go to an engine started on its own
  (``python -m megatron_ext.weight_export.engine [--model DIR] --address HOST:PORT``; without
  ``--model`` it builds the Hugging Face model from the config this script sends)
  at start, every ``--refit-every-n-steps`` iterations and at the end.
- ``--refit-transport p2p --refit-store HOST:PORT`` (or the ``--reshard-refit-*``
  aliases): each engine rank, started on its own (``python -m
  megatron_ext.weight_export.engine [--model DIR] --refit-store HOST:PORT --refit-rank R
  --refit-world-size W``), receives its own shards point to point from the trainer
  ranks that own them, at the same times (docs/weight_export_reshard.md). With
  ``--refit-engine megatron`` the engine is megatron-core's inference engine, one job of
  ``--refit-engine-tp`` x ``--refit-engine-dp`` ranks (``torchrun --nproc-per-node E -m
  megatron_ext.weight_export.engine --engine megatron --refit-store HOST:PORT
  --refit-rank-offset T --tp N``): the trainer publishes its model config, the engine
  builds the same GPTModel from it and takes Megatron's shards in place.

- ``--num-experts N`` (with Megatron-LM's ``--moe-*`` flags and ``--expert-model-parallel-size``):
  every layer an MoE layer of megatron-core's SequentialMLP experts, split over EP ranks (and, with
  ``--tensor-model-parallel-size`` > 1, which needs ``--sequence-parallel``, over expert TP ranks); the
  megatron-core engine takes them at ``--refit-engine-ep`` (its command's ``--ep``).
- ``--sequence-parallel`` (Megatron-LM's): the norms, dropouts and residuals split the sequence over
  each TP group; the local layer spec's norms are megatron_ext's ``LocalNorm`` (no Transformer Engine
  or Apex needed). Off at TP 1 as in Megatron-LM; with ``--ntp-*`` on every replica at TP > 1.
- ``--pipeline-model-parallel-size P`` (Megatron-LM's; processes = TP x PP x DP): the layers split over P
  stages, megatron-core's 1F1B schedule; ``--num-layers-per-virtual-pipeline-stage N`` gives each pipeline
  rank ``--num-layers / P / N`` model chunks and the interleaved schedule. Every PP degree holds the same
  global model (CPU initialization). Not with ``--ntp-*`` or the p2p refit; the export hook takes one chunk.

The same command runs on CPU (gloo; a tiny model) and on GPUs (NCCL, one GPU per
rank). Rank 0 prints a start-up summary of what the plugin enabled; the last rank
prints one line per ``--log-interval`` iterations (loss, tokens/s, ms/step,
memory on CUDA). See docs/megatron_lm.md.
"""

from __future__ import annotations

# Only the standard library at module level: megatron-core's checkpoint writer starts a
# helper process with the "spawn" method, which re-imports this file.
import argparse
import dataclasses
import datetime
import logging
import math
import os
import random
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRACKER = "latest_checkpointed_iteration.txt"
REFIT_ENGINES = ("hf", "megatron")
MOE_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


# ----------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    from megatron_ext.fsdp_symm import add_fsdp_symm_args
    from megatron_ext.nonuniform_tp import add_nonuniform_tp_args
    from megatron_ext.weight_export import add_refit_args

    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N examples/pretrain_gpt.py",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    g = p.add_argument_group("model (Megatron-LM names)")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true", help="use --num-query-groups KV heads")
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="KV heads with --group-query-attention (Megatron-LM ignores it without that flag; this script refuses it)",
    )
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="default 4 x hidden (with --swiglu: 8/3 x hidden, rounded down to a multiple of 64)",
    )
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden / heads")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (Llama)")
    g.add_argument("--qk-layernorm", action="store_true", help="layer norm on queries and keys (Qwen3, Qwen3-MoE)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no bias in linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary of the mock data (NullTokenizer); the model pads it (see next flag)",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this x TP (x lcm(tp_base, tp_reduced) under NTP)",
    )
    g.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="layer spec; only local is supported here (Transformer Engine is untested in megatron_ext)",
    )
    g.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        help="draw the full weights on CPU from --seed, so every TP and PP degree holds the same global "
        "model (always on without CUDA; required with --ntp-tp-base)",
    )

    g = p.add_argument_group(
        "mixture of experts (Megatron-LM names; every layer an MoE layer of SequentialMLP experts, dropless)"
    )
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (None or 0: a dense model)")
    g.add_argument(
        "--moe-ffn-hidden-size", type=int, default=None, help="each expert's ffn size (default --ffn-hidden-size)"
    )
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument(
        "--moe-router-pre-softmax",
        action="store_true",
        help="softmax over all experts before the top-k (default: top-k of the logits, softmax over those k)",
    )
    g.add_argument(
        "--moe-router-load-balancing-type",
        nargs="+",
        choices=MOE_BALANCING,
        default="aux_loss",
        help="aux_loss (GShard / Switch), seq_aux_loss (per sequence), global_aux_loss (over the data-parallel "
        "ranks), sinkhorn (S-BASE; not refittable) or none; several: one --moe-aux-loss-coeff each",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        nargs="+",
        default=0.0,
        help="scale of the load-balancing loss (1e-2 is a start)",
    )
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="scale of the router z-loss (1e-3 is a start)")
    g.add_argument(
        "--moe-router-dtype", choices=("fp32", "fp64"), default=None, help="routing and expert-output averaging dtype"
    )
    g.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall", "flex"),
        default="allgather",
        help="how tokens reach their experts' EP ranks (flex is refused: it needs DeepEP / HybridEP)",
    )
    g.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="refused: grouped-GEMM experts (TEGroupedMLP) need Transformer Engine; the local spec runs SequentialMLP",
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default micro-batch-size x data-parallel size (one micro-batch per rank)",
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="the loss of a step is the mean over its tokens (Megatron-LM's flag): needed by --ntp-share-unit "
        "sample, where a replica's last micro-batch may be partial",
    )
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 model, fp32 main params and grads reduced in fp32")
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="reduce gradients in fp32 (on with --bf16, as in Megatron-LM)",
    )
    g.add_argument("--log-interval", type=int, default=100)

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"), default="linear"
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("distributed")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="uniform TP degree; with --ntp-tp-base leave it at 1 or set it to tp_base",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron-LM's sequence parallelism: the norms, dropouts and residuals of each TP group split "
        "the sequence (--seq-length divisible by the TP degree(s)); off at TP 1, as in Megatron-LM; under "
        "--ntp-tp-base on every replica at TP > 1",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="pipeline stages (Megatron-LM's): each holds --num-layers / P layers, the first the embedding, the "
        "last the output layer and the loss; processes = TP x PP x data-parallel size",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Megatron-LM's interleaved 1F1B: each pipeline rank holds --num-layers / P / N model chunks of N "
        "layers (a single chunk: the plain 1F1B schedule); the micro-batches per step must be a multiple of P",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="EP: the experts of each MoE layer split over this many ranks (divides --num-experts and the ranks)",
    )
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="expert TP: each expert's weights split over this many ranks (default --tensor-model-parallel-size)",
    )
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="elements per DDP bucket (Megatron's default)")
    g.add_argument(
        "--distributed-backend", choices=("nccl", "gloo"), default=None, help="default nccl with CUDA, gloo without"
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("checkpointing (dist_checkpointing, torch_dist format)")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--no-load-optim", action="store_true", help="load the model only")
    g.add_argument(
        "--log-checkpoint-digest",
        action="store_true",
        help="print SHA-256 digests of the model and of the optimizer state as checkpointed, after each save and "
        "load: equal digests are bit-identical state (comparable between jobs of one TP degree, an NTP job's "
        "tp_base included, and with --use-distributed-optimizer one data-parallel size; copies every tensor to "
        "the CPU)",
    )

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="MockGPTDataset (the default; accepted for Megatron-LM)")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="a tokenized (.bin/.idx) dataset: [weight] prefix ...; token ids must be < --vocab-size",
    )
    g.add_argument("--split", default="99,1,0", help="train/valid/test split of --data-path")
    g.add_argument("--data-cache-path", default=None)

    add_nonuniform_tp_args(p)
    add_fsdp_symm_args(p)
    add_refit_args(p)
    p.add_argument(
        "--refit-engine",
        choices=REFIT_ENGINES,
        default="hf",
        help="p2p: what the engine is: hf (a Hugging Face model in vLLM's layout: python -m "
        "megatron_ext.weight_export.engine --model DIR) or megatron (megatron-core's inference engine, built from "
        "the config this trainer publishes: ... engine --engine megatron)",
    )
    return p


@dataclasses.dataclass
class Plan:
    """What the flags resolve to (parse time, before any process group exists)."""

    world_size: int
    tp: int  # uniform TP degree (tp_base under NTP)
    dp: int  # data-parallel replicas
    padded_vocab_size: int
    shares: object  # BatchShares: each replica's micro-batches of every global batch
    ntp: object | None  # NonuniformTPConfig
    symm: object  # SymmMemConfig
    export: object | None  # RefitConfig (the export hook's)
    cuda: bool
    refit_engine: str = "hf"  # p2p: the engine's kind (--refit-engine)
    num_experts: int | None = None  # MoE: experts per layer (None: dense)
    ep: int = 1  # expert-parallel size
    etp: int = 1  # expert tensor-parallel size
    pp: int = 1  # pipeline stages
    vp: int | None = None  # model chunks per pipeline rank (interleaved 1F1B); None: one chunk

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: the ranks over which each expert's gradients are reduced."""
        return self.world_size // (self.pp * self.ep * self.etp)

    @property
    def chunks(self) -> int:
        """Model chunks on each rank: one per virtual pipeline stage."""
        return self.vp or 1

    @property
    def balanced(self) -> bool:
        """--ntp-balance other than none: replicas take unequal shares (else Megatron's equal split)."""
        return self.ntp is not None and self.ntp.balance != "none"


def _refuse(parser, msg: str):
    """Refuse a flag combination on every rank; only rank 0 prints it."""
    if int(os.environ.get("RANK", "0")) == 0:
        parser.error(msg)
    sys.exit(2)


def parse_args(argv=None, world_size: int | None = None, cuda: bool | None = None):
    """Parse and check the flags; returns ``(args, plan)``. Bad combinations exit with status 2
    and a message naming the flag and what it accepts."""
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    # the plugin's INFO lines (the --ntp-policy decision, batch shares) from global rank 0
    logging.basicConfig(format="%(message)s")
    logging.getLogger("megatron_ext").setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    cuda = torch.cuda.is_available() if cuda is None else cuda
    try:
        plan = _check(args, world_size, cuda, parser)
    except ValueError as exc:
        _refuse(parser, str(exc))
    return args, plan


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _check(args, world_size: int, cuda: bool, parser) -> Plan:
    from megatron_ext.fsdp_symm import SymmMemConfig
    from megatron_ext.nonuniform_tp import NonuniformTPConfig, equal_batch_shares
    from megatron_ext.weight_export import RefitConfig

    _positive(
        args,
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "kv_channels",
        "seq_length",
        "max_position_embeddings",
        "vocab_size",
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "log_interval",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage",
        "save_interval",
        "make_vocab_size_divisible_by",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    )
    if args.num_experts == 0:  # Megatron-LM: 0 experts is a dense model
        args.num_experts = None
    _positive(args, "num_experts")
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        raise ValueError(
            f"--num-layers {args.num_layers} must be divisible by --pipeline-model-parallel-size {pp} (every stage "
            "holds as many layers)"
        )
    vp = _virtual_stages(args, pp)
    if args.transformer_impl != "local":
        raise ValueError(
            "--transformer-impl transformer_engine: not supported by this script (Transformer Engine "
            "paths are untested in megatron_ext); use --transformer-impl local"
        )
    if args.vocab_size is None:
        raise ValueError("--vocab-size is required: the mock data and --data-path use a NullTokenizer of that size")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ValueError(
            "--num-query-groups needs --group-query-attention (Megatron-LM ignores it without; "
            "add the flag or drop --num-query-groups)"
        )
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise ValueError(
            f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
            f"{args.num_attention_heads} (or set --kv-channels)"
        )
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.group_query_attention and groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups N (N divides --num-attention-heads)")
    if args.num_attention_heads % groups:
        raise ValueError(f"--num-query-groups {groups} must divide --num-attention-heads {args.num_attention_heads}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
        if args.ffn_hidden_size < 1:
            raise ValueError(
                f"--swiglu with --hidden-size {args.hidden_size}: the default ffn size rounds to 0; "
                "set --ffn-hidden-size"
            )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}"
        )
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if not cuda:
        args.use_cpu_initialization = True
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    if args.distributed_backend == "nccl" and not cuda:
        raise ValueError("--distributed-backend nccl needs CUDA; this machine has none: use gloo (the default here)")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if not 0 <= args.min_lr <= args.lr:
        raise ValueError(f"--min-lr {args.min_lr} must be in 0..--lr ({args.lr})")
    if not 0 <= args.lr_warmup_iters <= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be in 0..--lr-decay-iters ({args.lr_decay_iters})"
        )
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save DIR")
    if args.data_path is not None and not args.data_path:
        raise ValueError("--data-path needs at least one dataset prefix (or leave it out for mock data)")
    if args.data_path and args.mock_data:
        raise ValueError("--mock-data and --data-path: pick one (mock data is the default without --data-path)")

    symm = SymmMemConfig.from_args(args)
    args.world_size = world_size  # --ntp-policy auto predicts from it and the batch sizes
    if args.sequence_parallel and max(args.tensor_model_parallel_size, args.ntp_tp_base or 1) == 1:
        # Megatron-LM's validate_args: no sequence parallelism without tensor parallelism
        if int(os.environ.get("RANK", "0")) == 0:
            print("WARNING: Disabling sequence parallelism because tensor model parallelism is disabled", flush=True)
        args.sequence_parallel = False
    ntp = NonuniformTPConfig.from_args(args)  # with --sequence-parallel: --seq-length splits at both degrees
    tp = args.tensor_model_parallel_size
    if ntp is not None:
        if tp not in (1, ntp.tp_base):
            raise ValueError(
                f"--tensor-model-parallel-size {tp} with --ntp-tp-base {ntp.tp_base}: leave it at 1 "
                f"or set it to {ntp.tp_base} (NTP builds the TP groups)"
            )
        if cuda and not args.use_cpu_initialization:
            raise ValueError(
                "--ntp-tp-base needs --use-cpu-initialization on GPUs: replicas at different TP "
                "degrees must draw the same global model"
            )
        tp = ntp.tp_base
        degrees = sorted({ntp.tp_base, ntp.tp_reduced})
        multiple = args.make_vocab_size_divisible_by * math.lcm(*degrees)
        padded = -(-args.vocab_size // multiple) * multiple
        dataclasses.replace(
            ntp,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=groups if args.group_query_attention else None,
            ffn_hidden_size=args.ffn_hidden_size,
            vocab_size=padded,
        )
        dp = ntp.kept_replicas(ntp.layout(world_size).num_replicas)  # --ntp-policy drop: the healthy ones
        degrees_text = f"TP degrees {degrees}"
    else:
        if world_size % (tp * pp):
            model = f"--tensor-model-parallel-size {tp}" + (
                f" x --pipeline-model-parallel-size {pp} = {tp * pp}" if pp > 1 else ""
            )
            raise ValueError(
                f"{model} must divide the number of processes ({world_size}, torchrun --nproc-per-node x --nnodes)"
            )
        if args.sequence_parallel and args.seq_length % tp:
            raise ValueError(
                f"--seq-length {args.seq_length} must be divisible by --tensor-model-parallel-size {tp} with "
                "--sequence-parallel (each TP rank holds its part of the sequence)"
            )
        multiple = args.make_vocab_size_divisible_by * tp
        padded = -(-args.vocab_size // multiple) * multiple
        dp = world_size // (tp * pp)
        degrees, degrees_text = [tp], f"--tensor-model-parallel-size {tp}"
    for name, value in (
        ("--num-attention-heads", args.num_attention_heads),
        ("--num-query-groups", groups),
        ("--ffn-hidden-size", args.ffn_hidden_size),
    ):
        bad = [d for d in degrees if value % d]
        if bad:
            raise ValueError(f"{name} {value} must be divisible by {degrees_text} (not by {bad})")
    ep, etp = _check_moe(args, world_size, tp, pp, ntp, parser)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if ntp is not None and ntp.balance != "none":
        # Each replica takes a share of every global batch (--ntp-balance); refused here if impossible.
        shares = ntp.batch_shares(args.global_batch_size, args.micro_batch_size, num_replicas=dp)
    elif args.global_batch_size % per_step:
        lo = max(per_step, args.global_batch_size // per_step * per_step)
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size x data-parallel "
            f"size = {args.micro_batch_size} x {dp} = {per_step} (e.g. {lo} or {lo + per_step})"
        )
    else:
        shares = equal_batch_shares(dp, args.global_batch_size, args.micro_batch_size)  # Megatron's split
    steps = args.global_batch_size // per_step  # micro-batches per replica (equal shares)
    if vp is not None and steps % pp:
        lo = -(-steps // pp) * pp * per_step
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}: the interleaved "
            f"schedule runs the micro-batches in groups of --pipeline-model-parallel-size {pp}, and a step has "
            f"--global-batch-size {args.global_batch_size} / (--micro-batch-size {args.micro_batch_size} x "
            f"data-parallel size {dp}) = {steps}: make it a multiple of {pp} (e.g. --global-batch-size {lo})"
        )

    export = None
    if args.refit_vocab_size is None and args.refit_target is not None:
        args.refit_vocab_size = args.vocab_size
    refit = RefitConfig.from_args(args)
    if refit.p2p and (refit.store is None or ntp is not None):
        raise ValueError(
            "--refit-transport p2p (the --reshard-refit-* flags) in this script refits an engine started on its "
            "own (python -m megatron_ext.weight_export.engine --model DIR --refit-store HOST:PORT --refit-rank R "
            "--refit-world-size W, or --engine megatron --refit-store HOST:PORT --refit-rank-offset T): give "
            "--refit-store HOST:PORT"
            + (" and leave out --ntp-* (a nonuniform-TP trainer refits through the library)" if ntp else "")
        )
    if pp > 1 and refit.p2p:
        raise ValueError(
            f"--refit-transport p2p (--refit-store, --reshard-refit-*) with --pipeline-model-parallel-size {pp}: the "
            "p2p refit reads its layout from one stage's model here; refit a pipelined job through the export hook "
            "(--refit-target HOST:PORT --refit-transport broadcast) or train at --pipeline-model-parallel-size 1"
        )
    if vp is not None and refit.target is not None:
        raise ValueError(
            f"--refit-target with --num-layers-per-virtual-pipeline-stage "
            f"{args.num_layers_per_virtual_pipeline_stage}: the export hook reads one model chunk per rank; leave "
            "out --num-layers-per-virtual-pipeline-stage (plain 1F1B) or the refit"
        )
    if args.refit_engine == "megatron":
        _check_megatron_engine(args, refit, groups, padded)
    if args.num_experts is None and refit.engine_ep != RefitConfig.engine_ep:
        raise ValueError(
            f"--refit-engine-ep {refit.engine_ep}: the model is dense (no --num-experts), the engine has no experts "
            "to split; drop it"
        )
    if refit.target is None and not refit.p2p:
        changed = [
            f for f in ("every_n_steps", "bucket_size_mb", "transport") if getattr(refit, f) != getattr(RefitConfig, f)
        ]
        if changed:
            raise ValueError(
                f"{', '.join('--refit-' + f.replace('_', '-') for f in changed)} given without --refit-target "
                "HOST:PORT (the engine's address: python -m megatron_ext.weight_export.engine --model DIR "
                "--address HOST:PORT)"
            )
    else:
        if refit.transport == "inprocess":
            raise ValueError(
                "--refit-target needs --refit-transport broadcast (engine on CPU or another GPU), ipc or "
                "ipc-push (engine on this job's first GPU); inprocess has no engine in this script"
            )
        llama = {
            "--position-embedding-type rope": args.position_embedding_type == "rope",
            "--normalization RMSNorm": args.normalization == "RMSNorm",
            "--swiglu": args.swiglu,
            "--disable-bias-linear": args.disable_bias_linear,
        }
        qwen3_moe = args.num_experts is not None and (refit.target is not None or args.refit_engine == "hf")
        if qwen3_moe:
            llama["--qk-layernorm"] = args.qk_layernorm  # Qwen3-MoE normalises queries and keys
        missing = [flag for flag, ok in llama.items() if not ok]
        if missing:
            raise ValueError(
                f"--refit-{'store' if refit.p2p else 'target'} refits in Hugging Face "
                f"{'Qwen3-MoE' if qwen3_moe else 'Llama'} naming: add {' '.join(missing)} (the model must be "
                f"{'Qwen3-MoE' if qwen3_moe else 'Llama'}-shaped)"
            )
        _check_refit_routing(args, "--refit-" + ("store" if refit.p2p else "target"))
        export = refit

    if args.data_path is None:
        args.mock_data = True
    return Plan(
        world_size=world_size,
        tp=tp,
        dp=dp,
        padded_vocab_size=padded,
        shares=shares,
        ntp=ntp,
        symm=symm,
        export=export,
        cuda=cuda,
        refit_engine=args.refit_engine,
        num_experts=args.num_experts,
        ep=ep,
        etp=etp,
        pp=pp,
        vp=vp,
    )


def _virtual_stages(args, pp: int) -> int | None:
    """Megatron-LM's virtual pipeline size from --num-layers-per-virtual-pipeline-stage: the model chunks of
    each pipeline rank (None: one, the plain 1F1B schedule)."""
    n = args.num_layers_per_virtual_pipeline_stage
    if n is None:
        return None
    per_stage = args.num_layers // pp
    if per_stage % n:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {n} must divide the layers of each pipeline stage "
            f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp} = {per_stage})"
        )
    if per_stage == n:
        return None  # Megatron-LM: one chunk per rank
    if pp == 1:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {n} cuts the model into {per_stage // n} chunks, which the "
            "interleaved schedule runs over several pipeline ranks: add --pipeline-model-parallel-size > 1 (or leave "
            "the flag out)"
        )
    return per_stage // n


# MoE flags other than --num-experts (given without --num-experts, i.e. not at the parser's default: refused).
MOE_FLAGS = (
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_dtype",
    "moe_token_dispatcher_type",
    "moe_grouped_gemm",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_moe(args, world_size: int, tp: int, pp: int, ntp, parser) -> tuple[int, int]:
    """The MoE flags (Megatron-LM's names and defaults); returns ``(EP, expert TP)``."""
    if args.num_experts is None:
        defaults = {n: parser.get_default(n) for n in MOE_FLAGS}
        given = [_flag(n) for n, d in defaults.items() if getattr(args, n) not in (d, [d])]
        if given:
            raise ValueError(f"{', '.join(given)} given without --num-experts N (the model is dense)")
        return 1, 1
    n = args.num_experts
    if args.moe_grouped_gemm:
        raise ValueError(
            "--moe-grouped-gemm: grouped-GEMM experts (TEGroupedMLP) need Transformer Engine; this script builds "
            "megatron-core's local layer spec, whose experts are SequentialMLP: drop the flag"
        )
    if args.moe_token_dispatcher_type == "flex":
        raise ValueError(
            "--moe-token-dispatcher-type flex needs DeepEP / HybridEP, which this script does not set up: use "
            "allgather (the default) or alltoall"
        )
    if ntp is not None:
        raise ValueError(
            f"--num-experts {n} with --ntp-tp-base: nonuniform TP does not train MoE models (the router's token "
            "counts and load-balancing statistics are reduced over groups that differ between healthy and degraded "
            "replicas); drop --ntp-* or --num-experts"
        )
    if tp != 1 and not args.sequence_parallel:
        raise ValueError(
            f"--num-experts with --tensor-model-parallel-size {tp}: megatron-core trains MoE layers under TP only "
            "with sequence parallelism: add --sequence-parallel (or use --tensor-model-parallel-size 1 and split "
            "the experts with --expert-model-parallel-size)"
        )
    if args.moe_router_topk > n:
        raise ValueError(f"--moe-router-topk {args.moe_router_topk} must be in 1..--num-experts ({n})")
    kinds, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    kinds = [kinds] if isinstance(kinds, str) else kinds
    coeffs = [coeffs] if isinstance(coeffs, float) else coeffs
    if len(kinds) > 1 or len(coeffs) > 1:
        if len(kinds) != len(coeffs):
            raise ValueError(
                f"--moe-router-load-balancing-type {' '.join(kinds)} takes one --moe-aux-loss-coeff each, "
                f"got {len(coeffs)}: {' '.join(map(str, coeffs))}"
            )
    # Megatron-LM's validate_args: one value is a plain value, several a list
    args.moe_router_load_balancing_type = kinds[0] if len(kinds) == 1 else kinds
    args.moe_aux_loss_coeff = coeffs[0] if len(coeffs) == 1 else coeffs
    ep = args.expert_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp  # Megatron-LM's default
    etp = args.expert_tensor_parallel_size
    stage = world_size // pp  # the ranks of one pipeline stage
    if stage % (ep * etp):
        where = f"number of processes ({world_size}" if pp == 1 else f"processes of each pipeline stage ({stage}"
        raise ValueError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} must divide the "
            f"{where} = data-parallel size x --tensor-model-parallel-size {tp}): the expert grid is EP x expert TP x "
            "expert data-parallel"
        )
    if n % ep:
        raise ValueError(f"--num-experts {n} must be divisible by --expert-model-parallel-size {ep}")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size  # Megatron-LM's default
    if args.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} must be divisible by --expert-tensor-parallel-size {etp}"
        )
    return ep, etp


def _check_refit_routing(args, flag: str) -> None:
    """An MoE model refits only where the engine routes as Megatron does (softmax top-k)."""
    from megatron_ext.sharding.moe import TOPK_BALANCING

    kinds = args.moe_router_load_balancing_type
    other = [k for k in ([kinds] if isinstance(kinds, str) else kinds) if k not in TOPK_BALANCING]
    if args.num_experts is not None and other:
        raise ValueError(
            f"{flag} with --moe-router-load-balancing-type {other[0]}: Megatron routes {other[0]}-balanced experts "
            f"otherwise than an engine's softmax top-k; refit models trained with {', '.join(TOPK_BALANCING[:-1])} "
            f"or {TOPK_BALANCING[-1]}"
        )


def _check_megatron_engine(args, refit, groups: int, padded: int) -> None:
    """--refit-engine megatron: a p2p refit to an engine that builds this model at --refit-engine-tp."""
    from megatron_ext.weight_export import RefitConfig, engine_expert_tp

    if not refit.p2p or refit.store is None:
        raise ValueError(
            "--refit-engine megatron refits megatron-core's engine over the p2p refit: add --refit-transport p2p "
            "--refit-store HOST:PORT"
        )
    unread = {
        "--refit-vocab-padding": refit.vocab_padding != RefitConfig.vocab_padding,
        "--refit-quantize": refit.quantize != RefitConfig.quantize,
    }
    given = [flag for flag, changed in unread.items() if changed]
    if given:
        raise ValueError(
            f"{', '.join(given)}: not read with --refit-engine megatron (the engine builds this model: its "
            "padded vocabulary, its dtype); drop them"
        )
    tp, ep = refit.engine_tp, refit.engine_ep
    dense = [("--num-attention-heads", args.num_attention_heads), ("--num-query-groups", groups)]
    if args.num_experts is None:
        dense.append(("--ffn-hidden-size", args.ffn_hidden_size))  # MoE layers have no dense MLP
    for name, value in (*dense, ("the padded vocabulary", padded)):
        if value % tp:
            raise ValueError(f"{name} {value} must be divisible by --refit-engine-tp {tp} (the engine's TP)")
    if args.num_experts is None:
        return  # a dense model's --refit-engine-ep: _check
    if args.num_experts % ep:
        raise ValueError(
            f"--num-experts {args.num_experts} must be divisible by --refit-engine-ep {ep} (the engine's EP)"
        )
    etp = engine_expert_tp(tp, ep)
    if args.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} must be divisible by --refit-engine-tp {tp} (the "
            "engine shards experts over its TP at --refit-engine-ep 1), or give --refit-engine-ep > 1 (whole experts)"
        )
    _check_refit_routing(args, "--refit-engine megatron")


# ------------------------------------------------------------------------------------------ helpers
def print_rank_0(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def print_rank_last(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


def set_random_seed(seed: int) -> None:
    """Megatron-LM's ``_set_random_seed``: each pipeline stage its own seed (``seed + 100 x`` its rank)."""
    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    seed += 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize_distributed(args, plan: Plan):
    """Process group, Megatron's parallel state, NTP groups. Returns the NTP groups (None without NTP)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if plan.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        # megatron-core calls torch.cuda unconditionally in a few places; these shims
        # redirect them to CPU in this process only (examples and tests, never the plugin).
        from megatron_ext.testing import cpu_compat

        cpu_compat.install()
    kwargs = {}
    if args.distributed_backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        args.distributed_backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes), **kwargs
    )
    if plan.ntp is None:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=plan.tp,
            pipeline_model_parallel_size=plan.pp,
            virtual_pipeline_model_parallel_size=plan.vp,
            expert_model_parallel_size=plan.ep,
            expert_tensor_parallel_size=plan.etp,
        )
        return None
    from megatron_ext.nonuniform_tp import initialize_nonuniform_tp_process_groups

    # TP=1 and the pipeline stages (Megatron's pipeline groups are the NTP job's): the NTP groups replace TP and DP
    ps.initialize_model_parallel(pipeline_model_parallel_size=plan.pp, virtual_pipeline_model_parallel_size=plan.vp)
    return initialize_nonuniform_tp_process_groups(plan.ntp)


def transformer_config(args, plan: Plan, tp: int):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.sharding import UNFUSED_LOCAL_SPEC

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    moe = {}
    if plan.num_experts is not None:
        moe = dict(
            num_moe_experts=plan.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_z_loss_coeff=args.moe_z_loss_coeff,
            moe_router_dtype=args.moe_router_dtype,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=False,
            expert_model_parallel_size=plan.ep,
            expert_tensor_parallel_size=plan.etp,
        )
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        qk_layernorm=args.qk_layernorm,
        calculate_per_token_loss=args.calculate_per_token_loss,
        tensor_model_parallel_size=tp,
        sequence_parallel=args.sequence_parallel and tp > 1,  # a degraded NTP replica at TP 1 runs without
        pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vp,
        # Megatron-LM's core_transformer_config_from_args: p2p overlapped with compute in the interleaved
        # schedule (its default), batched otherwise; each stage's sent activations freed once sent
        overlap_p2p_comm=plan.vp is not None,
        batch_p2p_comm=plan.vp is None,
        deallocate_pipeline_outputs=True,
        use_cpu_initialization=args.use_cpu_initialization,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **moe,
        **UNFUSED_LOCAL_SPEC,
    )


def get_model(args, plan: Plan, config, device) -> list:
    """Megatron-LM's ``get_model``: this pipeline rank's model chunks, one per virtual stage (one without)."""
    if plan.vp is None:
        return [build_model(args, plan, config, device)]
    return [build_model(args, plan, config, device, vp_stage) for vp_stage in range(plan.vp)]


def build_model(args, plan: Plan, config, device, vp_stage: int | None = None):
    """Megatron-LM's ``model_provider`` for GPT on the local layer spec, its norms megatron_ext's
    ``LocalNorm`` (torch's LayerNorm / RMSNorm, with sequence parallelism): the model chunk of this pipeline
    rank's virtual stage ``vp_stage`` (its only one without virtual stages); the first stage's first chunk
    holds the embedding, the last stage's last chunk the output layer.

    With CPU initialization every layout holds the same global model: the chunk's weights are drawn from
    --seed as a PP1 job draws them, after drawing and dropping what that job draws before them (the
    embedding, the layers of earlier chunks), in an RNG of their own (training goes on from the stage's
    seed, which the rank's first chunk sets as Megatron-LM's initialization does)."""
    import contextlib

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_ext.layers import local_gpt_block_spec

    if not vp_stage:  # the rank's first (or only) chunk: the seeds, once, before any weight is drawn
        set_random_seed(args.seed)
    spec = get_gpt_layer_local_spec(
        num_experts=plan.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=args.qk_layernorm,
        normalization=args.normalization,
    )
    if plan.num_experts is not None and args.use_cpu_initialization:
        spec = _global_draw_experts(spec)
    block = local_gpt_block_spec(config, spec, vp_stage=vp_stage)
    pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    cpu_draws = args.use_cpu_initialization
    with torch.random.fork_rng(devices=[]) if cpu_draws else contextlib.nullcontext():
        if cpu_draws:
            torch.default_generator.manual_seed(args.seed)
            first = get_transformer_layer_offset(config, vp_stage=vp_stage)
            _draw_and_drop(args, plan, config, block.layer_specs[0], first, embedding=not pre)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=plan.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre,
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            vp_stage=vp_stage,
        ).to(device)
    return Float16Module(config, model) if args.bf16 else model


def _draw_and_drop(args, plan: Plan, config, layer_spec, layers: int, embedding: bool) -> None:
    """Draw, as a PP1 job does (CPU initialization), the embedding if ``embedding`` and then ``layers``
    transformer layers of ``layer_spec``, and drop them: the RNG stream goes on where that job's does."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.spec_utils import build_module

    if embedding:
        LanguageModelEmbedding(
            config,
            vocab_size=plan.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            position_embedding_type=args.position_embedding_type,
        )
    for number in range(1, layers + 1):
        build_module(layer_spec, config=config, layer_number=number, add_layer_offset=False)


def _global_draw_experts(spec):
    """``spec`` with its SequentialMLP experts drawn as at EP 1 on every EP rank (CPU initialization).

    On CPU, megatron-core draws each expert's full weights from the one global RNG stream, local expert
    by local expert: at EP > 1 an EP rank would draw its first local experts' values (the same on every
    EP rank) and every later weight would shift along the stream. This subclass draws, around its own
    experts, the experts of the lower and the higher EP ranks and drops them, so each expert holds the
    values of its global index and the stream goes on as at EP 1: the same global model at every EP and
    expert-TP degree (each draw is a whole expert, split afterwards), as at every TP degree."""
    import copy
    import dataclasses as dc

    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GlobalDrawSequentialMLP(SequentialMLP):
        def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
            ep_rank, ep = pg_collection.ep.rank(), pg_collection.ep.size()
            expert_config = config  # as SequentialMLP builds its experts (MLP reads ffn_hidden_size from it)
            if config.moe_ffn_hidden_size != config.ffn_hidden_size:
                expert_config = copy.deepcopy(config)
                expert_config.ffn_hidden_size = config.moe_ffn_hidden_size
            self._skip(num_local_experts * ep_rank, expert_config, submodules, pg_collection)  # lower EP ranks'
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
            self._skip(num_local_experts * (ep - 1 - ep_rank), expert_config, submodules, pg_collection)  # higher

        @staticmethod
        def _skip(count, config, submodules, pg_collection):
            for _ in range(count):  # SequentialMLP's own expert, built and dropped: the same draws
                MLP(
                    config,
                    submodules,
                    ffn_hidden_size=config.moe_ffn_hidden_size,
                    is_expert=True,
                    tp_group=pg_collection.expt_tp,
                )

    mlp = spec.submodules.mlp  # partial(MoELayer, submodules=MoESubmodules(experts=partial(SequentialMLP, ...)))
    moe = mlp.keywords["submodules"]
    if moe.experts.func is not SequentialMLP:
        raise TypeError(f"expected SequentialMLP experts in the local layer spec, got {moe.experts.func}")
    experts = partial(GlobalDrawSequentialMLP, *moe.experts.args, **moe.experts.keywords)
    mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": dc.replace(moe, experts=experts)})
    return dc.replace(spec, submodules=dc.replace(spec.submodules, mlp=mlp))


def wrap_model(args, plan: Plan, config, chunks: list) -> list:
    """The DDP wrapper the flags ask for, one per model chunk: the plugin's NTP DDP, its symmetric-memory DDP,
    or Megatron's."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
    )
    symm = plan.symm if plan.symm.mode != "off" else None
    if plan.ntp is not None:
        from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel

        kwargs = {"batch_shares": plan.shares} if plan.balanced else {}
        return [
            NonuniformTPDistributedDataParallel(
                config, ddp_config, model, ntp_config=plan.ntp, symm_mem_config=symm, **kwargs
            )
            for model in chunks  # (several only in a uniform job: the interleaved schedule is refused with failures)
        ]
    wrapper = DistributedDataParallel
    if symm is not None:
        from megatron_ext.fsdp_symm import SymmMemDistributedDataParallel

        wrapper = partial(SymmMemDistributedDataParallel, symm_mem_config=symm)
    # Megatron-LM's get_model: the chunks after the first in one bucket each (their communication overlaps
    # the other chunks' compute anyway)
    return [
        wrapper(config=config, ddp_config=ddp_config, module=model, disable_bucketing=i > 0)
        for i, model in enumerate(chunks)
    ]


# --------------------------------------------------------------------------------------------- data
class NullTokenizer:
    """Megatron-LM's ``--tokenizer-type NullTokenizer`` for pre-tokenized and mock data: ids
    ``0..vocab_size-1``, the last one end-of-document, no padding id. (megatron-core has one in
    ``megatron.core.tokenizers``, but importing it imports ``transformers``.)"""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = -1

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "NullTokenizer", "vocab_size": self.vocab_size, "eod_id": self.eod}


def build_train_data(args, plan: Plan, consumed_samples: int):
    """The training split of MockGPTDataset (or GPTDataset over --data-path) and the batch sampler
    reading this replica's share of it from ``consumed_samples``: ``(dataset, sampler)``."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    total = args.train_iters * args.global_batch_size
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=NullTokenizer(vocab_size=args.vocab_size),
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
    )
    cls = MockGPTDataset if config.mock else GPTDataset
    # Every rank reads its batches itself (an NTP replica has no TP rank 0 to broadcast from); with
    # --data-cache-path rank 0 builds the index and the others read it.
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [total, 0, 0], lambda: True, config).build()
    dist.barrier()
    # Megatron-LM's MegatronPretrainingSampler order; with --ntp-balance each replica takes its own share.
    from megatron_ext.nonuniform_tp import BalancedPretrainingSampler

    return train, BalancedPretrainingSampler(total, consumed_samples, plan.shares)


def data_iterators(dataset, sampler, chunks: int) -> list:
    """The micro-batches ``sampler`` picks from ``dataset`` (new ones after each sampler switch): one iterator
    per model chunk, each over all of them (every chunk of every stage reads each micro-batch; the first
    stage uses its tokens, the last its labels and loss mask)."""
    import torch

    return [
        iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0, pin_memory=False))
        for _ in range(chunks)
    ]


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's GPT loss: sum over unmasked tokens, their count, and both for the log."""
    import torch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def forward_step(device, data_iterator, model):
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    output = model(tokens, batch["position_ids"].to(device), batch["attention_mask"].to(device), labels=labels)
    return output, partial(loss_func, batch["loss_mask"].to(device))


# -------------------------------------------------------------------------------------- checkpoints
def optimizer_metadata(args) -> dict:
    """The distributed optimizer's checkpoint format: ``dp_reshardable`` (per DP shard; resumes
    at the same TP layout, any DP size). Its TP-reshardable formats do not work in megatron-core
    0.19.2 without Apex / Transformer Engine: ``fully_sharded_model_space`` is refused by the
    writer, and loading ``fully_reshardable`` fails on torch Adam's ``step`` state (KeyError in
    ``DistributedOptimizer._set_main_param_and_optimizer_states``)."""
    return {"distrib_optim_sharding_type": "dp_reshardable"} if args.use_distributed_optimizer else {}


def _layout_text(plan: Plan) -> str:
    if plan.ntp is None:
        experts = f" (experts EP={plan.ep} x ETP={plan.etp})" if plan.num_experts is not None else ""
        pp = f" x PP={plan.pp}" + (f" ({plan.vp} model chunks per rank)" if plan.vp else "") if plan.pp > 1 else ""
        return f"uniform TP={plan.tp}{pp} x DP={plan.dp}{experts}"
    return (
        f"NTP tp_base={plan.ntp.tp_base} tp_reduced={plan.ntp.tp_reduced} x {plan.dp} replicas "
        f"(failed slots {plan.ntp.non_active_ranks_per_dp})"
    )


def _tp_layout(plan: Plan) -> list:
    """The layout of the ranks that write a checkpoint's training state: one TP degree (and PP with its model
    chunks, EP x expert TP). An NTP job's state is its healthy replicas', a uniform ``tp_base`` job's
    (degraded replicas write none), so an NTP job and a uniform ``tp_base`` job have the same."""
    tp = plan.tp if plan.ntp is None else plan.ntp.tp_base
    pp = ["pp", plan.pp, plan.chunks] if plan.pp > 1 else []
    return ["uniform", tp] + pp + ([plan.ep, plan.etp] if plan.num_experts is not None else [])


def _canonical(x, out: list) -> None:
    """Bytes that stand for ``x`` (nested dicts and lists, tensors by dtype, shape and bits), into ``out``."""
    import torch

    if torch.is_tensor(x):
        t = x.detach().cpu().contiguous()
        out.append(f"tensor {t.dtype} {tuple(t.shape)}".encode())
        out.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        out.append(b"{")
        for k, v in x.items():
            out.append(repr(k).encode())
            _canonical(v, out)
        out.append(b"}")
    elif isinstance(x, (list, tuple)):
        out.append(b"[")
        for v in x:
            _canonical(v, out)
        out.append(b"]")
    else:
        out.append(repr(x).encode())


def _sha(x) -> str:
    import hashlib

    parts = []
    _canonical(x, parts)
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def model_state(model: list) -> dict | None:
    """This rank's model entries of a checkpoint, as Megatron-LM writes them: ``model`` (one model chunk) or
    ``model0``, ``model1``, ... (one per virtual pipeline stage); None on a degraded NTP replica (no entry).
    Their tensors are keyed by global layer, so any pipeline layout reads them."""
    from megatron_ext.nonuniform_tp import model_sharded_state_dict

    sds = [model_sharded_state_dict(m) for m in model]
    if sds[0] is None:
        return None
    return {"model": sds[0]} if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}


def state_digests(args, model: list, optimizer=None) -> dict:
    """``{"model": hex, "optimizer": hex}``: SHA-256 digests (16 hex digits) of what this job's checkpoint
    holds, from the live state: every main-replica shard of the sharded state dicts (key, offset, bits) and
    their non-sharded entries (``optimizer``: None leaves it out). Collective over all ranks (a degraded NTP
    replica adds nothing)."""
    import hashlib

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        apply_factories,
        is_main_replica,
    )

    mine = {"model": [], "optimizer": [], "model common": None, "optimizer common": None}
    models = model_state(model)
    if models is not None:
        state = {"model": models, "optimizer": {}}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(models, metadata=optimizer_metadata(args))
        apply_factories(state)
        common = {"model": [], "optimizer": []}

        def walk(x, part, path):
            if isinstance(x, dict):
                pad = x.get("padding")
                if isinstance(pad, LocalNonpersistentObject) and pad.unwrap() is True:
                    return  # the distributed optimizer's bucket padding (uninitialised memory)
                for k, v in x.items():
                    walk(v, part, (*path, k))
            elif isinstance(x, list):
                for i, v in enumerate(x):
                    walk(v, part, (*path, i))
            elif isinstance(x, (ShardedTensor, ShardedObject)):
                if is_main_replica(x.replica_id):
                    offset = tuple(x.global_offset)
                    flat = getattr(x, "flattened_range", None)
                    mine[part].append((x.key, offset, None if flat is None else (flat.start, flat.stop), _sha(x.data)))
            elif not isinstance(x, LocalNonpersistentObject):
                common[part].append((path, _sha(x)))

        for part in ("model", "optimizer"):
            walk(state[part], part, ())
            mine[f"{part} common"] = common[part]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in ("model", "optimizer") if optimizer is not None else ("model",):
        shards = sorted(s for e in everyone for s in e[part])
        common = next((e[f"{part} common"] for e in everyone if e[f"{part} common"] is not None), None)
        out[part] = hashlib.sha256(repr((shards, common)).encode()).hexdigest()[:16]
    return out


def _digest_text(args, model: list, optimizer) -> str:
    """The digests for the save and load lines (with --log-checkpoint-digest)."""
    if not args.log_checkpoint_digest:
        return ""
    d = state_digests(args, model, optimizer)
    return f"; digests: model {d['model']}, optimizer {d.get('optimizer', '(not loaded)')}"


def save_checkpoint(args, plan: Plan, iteration: int, consumed: int, model: list, optimizer, scheduler):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_ext.nonuniform_tp import share_common_state

    start = time.perf_counter()
    state = {
        "iteration": iteration,
        "consumed_train_samples": consumed,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": scheduler.state_dict(),
        "layout": _layout_text(plan),
        "tp_layout": _tp_layout(plan),
        "distributed_optimizer": args.use_distributed_optimizer,
        "padded_vocab_size": plan.padded_vocab_size,
    }
    # None on a degraded NTP replica: its partner's ranks hold its weights and the optimizer state
    models = model_state(model)
    if models is not None:
        state.update(models)
        state["optimizer"] = optimizer.sharded_state_dict(models, metadata=optimizer_metadata(args))
    share_common_state(state)  # NTP: global rank 0 may be degraded; it writes the non-sharded entries
    path = os.path.join(args.save, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.save, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    seconds = time.perf_counter() - start
    print_rank_0(
        f"saved checkpoint at iteration {iteration:7d} to {args.save} ({_layout_text(plan)}) in {seconds:.2f} s"
        + _digest_text(args, model, optimizer)
    )


def _restore_adam_steps(optimizer) -> None:
    """megatron-core 0.19.2's distributed optimizer over torch's Adam (no Apex / Transformer Engine)
    loads the checkpoint's step count into its param groups and gives every parameter's state
    one shared step tensor, which its per-bucket state copy then overwrites with the step held
    before the load; torch's Adam increments each parameter's step in place, so a shared tensor
    would count once per parameter. Give every parameter its own step, the group's loaded one."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = opt.optimizer.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = torch.full_like(state["step"], float(group["step"]))


def load_checkpoint(args, plan: Plan, model, optimizer, scheduler) -> tuple[int, int]:
    """Resume from ``--load``'s latest checkpoint (any TP and PP layout, NTP or uniform) into ``model`` (its
    chunks, or its one chunk alone). Returns ``(iteration, consumed_samples)``; ``(0, 0)`` when there is none."""
    import torch
    from megatron.core import dist_checkpointing

    model = model if isinstance(model, list) else [model]

    tracker = os.path.join(args.load, TRACKER)
    if not os.path.isfile(tracker):
        print_rank_0(f"no checkpoint at --load {args.load} (no {TRACKER}); training from scratch")
        return 0, 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = os.path.join(args.load, f"iter_{iteration:07d}")
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("padded_vocab_size", plan.padded_vocab_size) != plan.padded_vocab_size:
        raise RuntimeError(
            f"--load {args.load}: the checkpoint's embedding has {common['padded_vocab_size']} rows, this job pads "
            f"--vocab-size {args.vocab_size} to {plan.padded_vocab_size} (--make-vocab-size-divisible-by "
            f"{args.make_vocab_size_divisible_by} x its TP degree); pick --make-vocab-size-divisible-by so that both "
            "layouts pad to the same size"
        )
    if (
        not args.no_load_optim
        and common.get("distributed_optimizer", args.use_distributed_optimizer) != args.use_distributed_optimizer
    ):
        raise RuntimeError(
            f"--load {args.load}: the checkpoint's optimizer state was saved "
            f"{'with' if common.get('distributed_optimizer') else 'without'} --use-distributed-optimizer and this "
            "job runs the other way; match the flag, or resume the model only with --no-load-optim"
        )
    if args.use_distributed_optimizer and not args.no_load_optim and common.get("tp_layout") != _tp_layout(plan):
        raise RuntimeError(
            f"--load {args.load}: the distributed optimizer's state was saved by {common.get('layout')} and resumes "
            f"only at its TP degree and pipeline layout (megatron-core 0.19.2's TP-reshardable optimizer formats do "
            f"not work without Apex / Transformer Engine); this job is {_layout_text(plan)}. Resume at that layout "
            "(an NTP job's TP degree is its --ntp-tp-base), or the model only with --no-load-optim (a fresh "
            "optimizer state), or save without --use-distributed-optimizer"
        )
    if args.use_distributed_optimizer and not args.no_load_optim:
        # megatron-core 0.19's distributed optimizer over torch's Adam (no Apex / Transformer Engine)
        # has no state to describe before its first step (DistributedOptimizer.state_dict needs
        # Adam's "step"): take one with zero gradients; the load overwrites what it changed.
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.step()
    models = model_state(model)
    state = {}
    if models is not None:
        state.update(models)
        if not args.no_load_optim:
            state["optimizer"] = optimizer.sharded_state_dict(
                models, is_loading=True, metadata=optimizer_metadata(args)
            )
    loaded = dist_checkpointing.load(state, path)
    if models is not None:
        with torch.no_grad():
            for name, sd in models.items():
                for key, sh in sd.items():
                    got = loaded[name].get(key)
                    if torch.is_tensor(got) and got.data_ptr() != sh.data.data_ptr():
                        sh.data.copy_(got)
        if "optimizer" in state:
            with torch.no_grad():  # the distributed optimizer copies into fp32 main params in place
                optimizer.load_state_dict(loaded["optimizer"])
            if args.use_distributed_optimizer:
                _restore_adam_steps(optimizer)
    if hasattr(model[0], "sync_compute_params"):
        model[0].sync_compute_params()  # NTP (one model chunk): each degraded replica takes its partner's weights
    if not args.no_load_optim:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    print_rank_0(
        f"loaded checkpoint from {args.load} at iteration {iteration} (saved as {loaded.get('layout')}; "
        f"resumed as {_layout_text(plan)})" + _digest_text(args, model, None if args.no_load_optim else optimizer)
    )
    return iteration, int(loaded["consumed_train_samples"])


# ---------------------------------------------------------------------------------------- start-up
def startup_summary(args, plan: Plan, model: list, ntp_groups, exporter) -> None:
    """What the plugin enabled, printed once by rank 0 (facts gathered from every rank)."""
    import torch.distributed as dist

    decisions = [d for m in model for _, d in getattr(m, "symm_mem_decisions", [])]
    mine = (
        len(decisions),
        sum(d.symmetric for d in decisions),
        sorted({d.reason for d in decisions if not d.symmetric}),
    )
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    lines = [
        f"megatron_ext: {plan.world_size} ranks ({args.distributed_backend}), {_layout_text(plan)}, "
        + (
            f"global batch {args.global_batch_size} = {args.micro_batch_size} x {plan.dp} x "
            f"{plan.shares.microbatches[0]} micro-batches"
            if not plan.balanced
            else f"global batch {args.global_batch_size} in micro-batches of {args.micro_batch_size} (shares below)"
        )
        + f", padded vocab {plan.padded_vocab_size}, "
        f"DDP wrapper {type(model[0]).__name__}"
        + (", sequence parallel" + (" (at TP > 1)" if plan.ntp is not None else "") if args.sequence_parallel else "")
    ]
    if plan.num_experts is not None:
        lines.append(
            f"megatron_ext: MoE: {plan.num_experts} experts of ffn {args.moe_ffn_hidden_size} per layer, top-"
            f"{args.moe_router_topk} ({'softmax before top-k' if args.moe_router_pre_softmax else 'top-k, softmax'}),"
            f" load balancing {args.moe_router_load_balancing_type} (coefficient {args.moe_aux_loss_coeff}), "
            f"dispatcher {args.moe_token_dispatcher_type}; EP={plan.ep} x expert TP={plan.etp} x expert DP="
            f"{plan.expert_dp}, {plan.num_experts // plan.ep} local experts per rank"
        )
    if ntp_groups is not None and plan.ntp.drops:
        lay = ntp_groups.layout
        lines.append(
            f"megatron_ext: nonuniform TP: replica(s) {sorted(plan.ntp.non_active_ranks_per_dp)} dropped "
            f"(--ntp-policy), the healthy replicas train as a uniform job: TP={lay.tp_base} x DP={lay.num_replicas}, "
            f"TP groups {lay.all_tp_groups()}"
        )
    elif ntp_groups is not None:
        lay = ntp_groups.layout
        degraded = [d for d in range(lay.num_replicas) if lay.is_degraded(d)]
        shares = f", --ntp-balance {plan.ntp.balance}: {plan.shares.describe()}" if plan.balanced else ""
        if plan.ntp.balance == "measured":
            shares += f" until {plan.ntp.balance_measure_steps} iteration(s) are timed"
        pairs = ", ".join(f"{d} -> {p}" for d, p in lay.partners.items())
        lines.append(
            f"megatron_ext: nonuniform TP: on, tp_base={lay.tp_base}, replica(s) {degraded} at "
            f"TP={lay.tp_reduced}"
            + (f" in all {lay.pp} pipeline stages" if lay.pp > 1 else "")
            + f", TP groups {lay.all_tp_groups()}, launch {plan.ntp.launch_mode}"
            + (
                f", degraded -> partner replica {pairs} (transfers in units of <= {plan.ntp.transfer_chunk_mb:g} MiB)"
                if pairs
                else ""
            )
            + shares
        )
    else:
        lines.append("megatron_ext: nonuniform TP: off")
    if plan.symm.mode == "off":
        lines.append("megatron_ext: symmetric memory: off (Megatron's DDP buffers)")
    else:
        total, symm = sum(e[0] for e in everyone), sum(e[1] for e in everyone)
        reasons = sorted({r for e in everyone for r in e[2]})
        line = (
            f"megatron_ext: symmetric memory: mode={plan.symm.mode}, {symm} of {total} bucket buffers symmetric "
            "over all ranks"
        )
        if total and not symm and all(r.startswith("unavailable") for r in reasons):
            line += " (fallback to plain buffers)"
        if reasons:
            more = f" (+{len(reasons) - 3} more)" if len(reasons) > 3 else ""
            line += f"; plain because: {' | '.join(reasons[:3])}{more}"
        lines.append(line)
    if isinstance(exporter, P2PRefit):
        r = exporter.refit
        lines.append(
            f"megatron_ext: refit: p2p to the {'megatron-core ' if exporter.engine == 'megatron' else ''}engine at "
            f"{plan.export.store} (refit ranks {min(r.dst.ranks)}.."
            f"{max(r.dst.ranks)}, engine TP{plan.export.engine_tp} x DP{plan.export.engine_dp}"
            + (f" x EP{plan.export.engine_ep}" if plan.num_experts is not None else "")
            + ") at start, "
            + (f"every {plan.export.every_n_steps} iterations and " if plan.export.every_n_steps else "")
            + f"at the end; {len(r.src.specs)} HF tensors, "
            f"{sum(spec.nbytes for spec in r.src.specs.values()) / 2**20:.2f} MiB"
        )
    elif exporter is not None:
        p = exporter.plan
        when = (
            f"at start, every {plan.export.every_n_steps} iterations and at the end"
            if plan.export.every_n_steps
            else "at start and after the last iteration"
        )
        lines.append(
            f"megatron_ext: weight export: {plan.export.transport} to {plan.export.target} {when}; "
            f"{sum(1 for _ in p.tensors())} HF tensors, {p.total_bytes / 2**20:.2f} MiB in "
            f"{len(p.buckets)} buckets"
        )
    else:
        lines.append("megatron_ext: weight export: off")
    print_rank_0("\n".join(lines))


class P2PRefit:
    """The p2p (reshard) refit as this script drives the export hook: export / maybe_export / close.
    ``engine``: ``hf`` (whole HF tensors in vLLM's layout) or ``megatron`` (megatron-core's engine:
    Megatron's shards at the engine's TP, and this model's config published for the engine to build)."""

    def __init__(self, ddp, config, vocab_size: int, engine: str = "hf"):
        import torch.distributed as dist
        from megatron_ext.weight_export import TrainerRefit

        self.config, self.engine, self.is_export_rank = config, engine, dist.get_rank() == 0
        if engine == "megatron":
            from megatron_ext.weight_export.megatron_refit import megatron_trainer_refit

            world = dist.get_world_size() + config.engine_tp * config.engine_dp
            group = config.join(dist.get_rank(), world)
            try:
                self.refit = megatron_trainer_refit(
                    ddp,
                    group,
                    engine_tp=config.engine_tp,
                    engine_dp=config.engine_dp,
                    engine_ep=config.engine_ep,
                    **config.executor_kwargs,
                )
            except BaseException:
                group.close()
                raise
        else:
            self.refit = TrainerRefit.from_model(ddp, config, vocab_size=vocab_size)

    def export(self, version: int):
        """This rank's RefitStats and the version each engine refit rank holds afterwards."""
        return self.refit.refit(version), self.refit.engine_versions()

    def maybe_export(self, step: int):
        return self.export(step) if self.config.due(step) else None

    def close(self) -> None:
        self.refit.close()
        self.refit.group.close()


def report_export(exporter, result) -> None:
    if isinstance(exporter, P2PRefit):
        if result is not None and exporter.is_export_rank:
            stats, held = result
            print(
                f"refit: version {stats.version} (p2p, {stats.seconds * 1e3:.1f} ms, refit rank 0 sent "
                f"{stats.sent_bytes / 1e6:.2f} MB); engine ranks hold {held}",
                flush=True,
            )
        return
    if result is not None and exporter.is_export_rank:
        print(
            f"weight export: version {result.version} ({result.nbytes / 1e6:.2f} MB, {result.seconds * 1e3:.1f} ms); "
            f"engine applied {list(result.applied)}",
            flush=True,
        )


def moe_losses(num_microbatches: int, num_moe_layers: int) -> dict:
    """The router losses megatron-core's MoE layers recorded in this iteration (``load_balancing_loss``,
    ``z_loss``, ...), as Megatron-LM logs them (``MoEMetricsTracker.report``): collected over the pipeline
    stages (each fills its own layers' entries), summed over each one's reduce group, averaged over the
    data-parallel ranks, the micro-batches and the MoE layers; then cleared. (SUM and a division in place of
    ``ReduceOp.AVG``, which gloo does not have.) Collective over every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    out = {}
    for name in sorted(tracker.metrics):  # the same names on every rank: every layer is an MoE layer
        entry = tracker.metrics[name]
        values = entry.values.detach().float().clone()
        dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
        for group, average in ((entry.reduce_group, False), (entry.avg_group, True)):
            if group is not None:
                dist.all_reduce(values, group=group)
                values /= group.size() if average else 1
        if entry.needs_dp_avg:
            dp = ps.get_data_parallel_group()
            dist.all_reduce(values, group=dp)
            values /= dp.size()
        out[name] = (values.sum() / num_moe_layers / num_microbatches).item()
    tracker.clear()
    return out


# ------------------------------------------------------------------------------------------- train
def train(args, plan: Plan) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ntp_groups = initialize_distributed(args, plan)
    if ntp_groups is not None and not ntp_groups.is_active:
        why = (
            "its replica is dropped (--ntp-policy)" if plan.ntp.drops else "its NTP slot is out (launch_mode=simulate)"
        )
        print(f"rank {os.environ.get('RANK')}: {why}; leaving", flush=True)
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if plan.cuda else torch.device("cpu")
    tp = ps.get_tensor_model_parallel_world_size()
    config = transformer_config(args, plan, tp)
    model = wrap_model(args, plan, config, get_model(args, plan, config, device))  # one DDP per model chunk
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        model,
    )
    gbs = plan.shares.global_batch_size  # --global-batch-size, or less under --ntp-balance shrink
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    # What Megatron-LM's setup_model_and_optimizer hands the schedule.
    config.grad_scale_func = optimizer.scale_loss
    if plan.ntp is not None:
        # Megatron's, after adding a degraded replica's token count to its partner's (needed with
        # calculate_per_token_loss, which the NTP DDP checks; a plain pass-through otherwise)
        from megatron_ext.nonuniform_tp import finalize_model_grads
    config.finalize_model_grads_func = finalize_model_grads
    balance = None
    if plan.ntp is not None and plan.ntp.balance == "measured":
        from megatron_ext.nonuniform_tp import MeasuredBalance

        # The shares by TP degree (plan.shares) until the first iterations are timed: each replica's compute,
        # up to finalize_model_grads (before the gradient sync makes every replica wait for the slowest).
        balance = MeasuredBalance(plan.ntp, gbs, args.micro_batch_size, num_replicas=plan.dp)
        config.finalize_model_grads_func = balance.timed(finalize_model_grads)
    if args.overlap_grad_reduce:  # Megatron-LM's train(): a list with several model chunks
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        config.grad_sync_func = [m.start_grad_sync for m in model] if len(model) > 1 else model[0].start_grad_sync

    iteration, consumed = 0, 0
    if args.load:
        iteration, consumed = load_checkpoint(args, plan, model, optimizer, scheduler)
    first_iteration = iteration

    exporter = None
    if plan.export is not None:
        from megatron_ext.weight_export import WeightExporter

        (ddp,) = model  # one model chunk (_check)
        exporter = (
            P2PRefit(ddp, plan.export, args.vocab_size, plan.refit_engine)
            if plan.export.p2p
            else WeightExporter(ddp, plan.export)
        )
    startup_summary(args, plan, model, ntp_groups, exporter)
    if exporter is not None:
        # The starting weights go first (version = the iteration they are from): the engine checks the
        # plan (names, shapes, dtypes) now, not after the first --refit-every-n-steps iterations.
        report_export(exporter, exporter.export(version=iteration))
    if iteration >= args.train_iters:
        print_rank_0(f"checkpoint iteration {iteration} >= --train-iters {args.train_iters}: nothing to train")

    train_ds, sampler = build_train_data(args, plan, consumed)
    data = data_iterators(train_ds, sampler, len(model))
    forward_backward = get_forward_backward_func()
    # This replica's micro-batches per global batch (unequal under --ntp-balance).
    num_microbatches = plan.shares.num_microbatches()
    is_tp0 = ps.get_tensor_model_parallel_rank() == 0
    # The grad norm to log: a degraded NTP replica's optimizer owns nothing (its norm is 0), so every rank logs
    # the one the first healthy rank's optimizer computed (it rides on the loss all-reduce below).
    norm_rank = 0
    if ntp_groups is not None and ntp_groups.layout.nonuniform:
        norm_rank = ntp_groups.layout.tp_group_ranks(ntp_groups.layout.healthy_replicas[0])[0]
    tokens_per_iter = gbs * args.seq_length

    def new_window():  # what is summed between two log lines
        return dict(loss=0.0, iters=0, seconds=0.0, skipped=0, nan=0, moe={})

    window = new_window()
    saved_at = None
    for m in model:
        m.train()
    while iteration < args.train_iters:
        start = time.perf_counter()
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        if balance is not None:
            balance.step_started()
        losses = forward_backward(
            forward_step_func=partial(forward_step, device),
            data_iterator=data,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        iteration += 1
        consumed += gbs
        if ok:
            scheduler.step(increment=gbs)
        if balance is not None and balance.measuring:
            new = balance.step_finished()  # collective on the last timed iteration
            if new is not None:  # between global batches: the gradient weights and the data switch together
                for m in model:
                    m.set_batch_shares(new)
                num_microbatches = new.num_microbatches()
                if iteration < args.train_iters:
                    sampler = sampler.switch(new, consumed)
                    data = data_iterators(train_ds, sampler, len(model))
            if not balance.measuring:
                seconds = ", ".join(f"{s * 1e3:.1f}" for s in balance.seconds)
                print_rank_0(
                    f"megatron_ext: --ntp-balance measured after iteration {iteration}: median compute ms per "
                    f"replica [{seconds}]; {'now' if new is not None else 'kept'} {balance.shares.describe()}"
                )
        # The global batch's loss: token-weighted over every replica. One rank per replica (TP rank 0 of
        # the last pipeline stage, the only one with losses) contributes, so the same sum comes out of any
        # TP and PP layout, NTP included.
        total = torch.zeros(3, dtype=torch.float64, device=device)
        if is_tp0:
            for x in losses:
                total[:2] += x["lm loss"].to(torch.float64)
        if dist.get_rank() == norm_rank and grad_norm is not None:
            total[2] = float(grad_norm)
        dist.all_reduce(total)
        grad_norm = None if grad_norm is None else total[2].item()
        if plan.cuda:
            torch.cuda.synchronize()
        window["seconds"] += time.perf_counter() - start
        loss = (total[0] / total[1]).item()
        window["skipped"] += int(not ok)
        if not math.isfinite(loss):
            window["nan"] += 1
        else:
            window["loss"] += loss
            window["iters"] += 1
        if plan.num_experts is not None:
            for name, value in moe_losses(num_microbatches, args.num_layers).items():
                window["moe"][name] = window["moe"].get(name, 0.0) + value
        if exporter is not None:
            report_export(exporter, exporter.maybe_export(iteration))
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            n = max(window["iters"] + window["nan"], 1)
            ms = window["seconds"] * 1e3 / n
            lr = optimizer.param_groups[0]["lr"]
            line = (
                f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {consumed:12d} | elapsed time per iteration (ms): {ms:.1f} |"
                f" throughput (tokens/s): {tokens_per_iter * 1e3 / ms:.0f} | learning rate: {lr:.6E} |"
                f" global batch size: {gbs:5d} |"
            )
            if gbs != args.global_batch_size:  # --ntp-balance shrink: what the degraded replicas left out
                shrunk = 1 - gbs / args.global_batch_size
                line += f" (--global-batch-size {args.global_batch_size}, shrunk by {shrunk:.1%}) |"
            if window["iters"]:
                line += f" lm loss: {window['loss'] / window['iters']:.6E} |"
            for name, value in sorted(window["moe"].items()):
                line += f" {name}: {value / n:.6E} |"
            line += f" loss scale: {optimizer.get_loss_scale().item():.1f} |"
            if grad_norm is not None:
                line += f" grad norm: {grad_norm:.3f} |"
            line += (
                f" number of skipped iterations: {window['skipped']:3d} |"
                f" number of nan iterations: {window['nan']:3d} |"
            )
            if plan.cuda:
                line += (
                    f" mem (GiB) allocated: {torch.cuda.memory_allocated() / 2**30:.2f} |"
                    f" max allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} |"
                )
            print_rank_last(line)
            window = new_window()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args, plan, iteration, consumed, model, optimizer, scheduler)
            saved_at = iteration
    trained = iteration > first_iteration
    if args.save and trained and saved_at != iteration:
        save_checkpoint(args, plan, iteration, consumed, model, optimizer, scheduler)
    if exporter is not None:
        if trained and (not plan.export.every_n_steps or iteration % plan.export.every_n_steps):
            report_export(exporter, exporter.export(version=iteration))  # the final weights
        exporter.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args, plan = parse_args(argv)
    return train(args, plan)


if __name__ == "__main__":
    sys.exit(main())
