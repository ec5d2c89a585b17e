"""Streams bucketed weights from a Megatron-Core GPT model to inference engines.

Trainer side::

    exporter = WeightExporter(model, RefitConfig.from_args(args))
    result = exporter.maybe_export(step)       # or exporter.export()

Engine side: :func:`serve` (a process listening at the target address) with a
consumer exposing ``load_weights(iterable of (hf_name, tensor))``, or the
command ``python -m megatron_ext.weight_export.engine [--model DIR] --address
HOST:PORT`` for a Hugging Face model (without ``--model``: :class:`HFModelFromTrainer`,
built from the trainer's :func:`hf_model_config`); see docs/weight_export.md.

megatron-core's own inference engine as a p2p refit target (docs/weight_export_reshard.md):
:func:`megatron_trainer_refit` on the trainer's ranks; on the engine's, :func:`receive_model_config`,
:func:`megatron_model_problem` (or :func:`refuse_refit`), :func:`engine_expert_tp` (an MoE engine's expert TP
for ``initialize_model_parallel``), :func:`build_engine_model`, :class:`MegatronEngine` and
:class:`MegatronEngineRefit`.
"""

from ..sharding import (
    Box,
    Layout,
    TensorSpec,
    UnsupportedParameter,
    gpt_specs,
    hf_config_from_megatron,
    megatron_layout,
    megatron_layout_from_groups,
    ntp_megatron_layout,
    specs_from_config,
    specs_from_model,
)
from .config import TRANSPORTS, RefitConfig, add_refit_args
from .control.refit_group import RefitGroup
from .engines.gate import RefitGate, VerifyResult, megatron_logits, verify_export
from .engines.hf_model import HFModelFromTrainer, build_hf_model, hf_model_config
from .engines.megatron import MegatronEngine
from .engines.megatron_config import (
    build_engine_model,
    engine_expert_tp,
    megatron_model_config,
    megatron_model_problem,
    receive_model_config,
)
from .engines.receiver import HFModelConsumer, LoadWeightsConsumer, WeightReceiver
from .exec.reshard import FanoutRefit, ReshardExecutor, megatron_tensors, ntp_megatron_tensors
from .exporter import ExportResult, WeightExporter
from .megatron_refit import (
    MegatronEngineRefit,
    megatron_engine_layout,
    megatron_engine_specs,
    megatron_trainer_refit,
    refuse_refit,
)
from .plan.errors import (
    ControlError,
    NonFiniteWeights,
    PlanMismatch,
    ReceiverError,
    RefitError,
    RefitGroupError,
    RefitRejected,
    RefitStats,
)
from .plan.export_plan import BucketMeta, ExportPlan, TensorMeta, build_plan, check_plan, unpack
from .plan.fp8 import Fp8Sources
from .plan.layout import inference_layout
from .plan.reshard_plan import ReshardPlan, Transfer, build_reshard_plan, check_reshard_plan, fanout_plans
from .refit import EngineRefit, TrainerRefit
from .transports import BroadcastSender, InProcessSender, IpcDirectSender, IpcPushSender, IpcSender, serve

__all__ = [
    "RefitError",
    "ControlError",
    "Box",
    "FanoutRefit",
    "Layout",
    "RefitGate",
    "RefitRejected",
    "RefitStats",
    "ReshardExecutor",
    "ReshardPlan",
    "TensorSpec",
    "Transfer",
    "build_reshard_plan",
    "check_reshard_plan",
    "fanout_plans",
    "gpt_specs",
    "inference_layout",
    "megatron_layout",
    "megatron_layout_from_groups",
    "megatron_tensors",
    "ntp_megatron_layout",
    "ntp_megatron_tensors",
    "specs_from_config",
    "specs_from_model",
    "TRANSPORTS",
    "BroadcastSender",
    "BucketMeta",
    "ExportPlan",
    "ExportResult",
    "HFModelConsumer",
    "HFModelFromTrainer",
    "InProcessSender",
    "IpcDirectSender",
    "IpcPushSender",
    "IpcSender",
    "LoadWeightsConsumer",
    "NonFiniteWeights",
    "PlanMismatch",
    "ReceiverError",
    "TensorMeta",
    "UnsupportedParameter",
    "VerifyResult",
    "RefitConfig",
    "WeightExporter",
    "WeightReceiver",
    "add_refit_args",
    "build_plan",
    "check_plan",
    "hf_config_from_megatron",
    "hf_model_config",
    "build_hf_model",
    "megatron_logits",
    "serve",
    "unpack",
    "verify_export",
    "EngineRefit",
    "RefitGroup",
    "RefitGroupError",
    "TrainerRefit",
    "Fp8Sources",
    "MegatronEngine",
    "MegatronEngineRefit",
    "megatron_engine_layout",
    "megatron_engine_specs",
    "megatron_trainer_refit",
    "refuse_refit",
    "build_engine_model",
    "engine_expert_tp",
    "megatron_model_config",
    "megatron_model_problem",
    "receive_model_config",
]
