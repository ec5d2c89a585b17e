"""The export hook: plan once, gather bucket by bucket, send, report versions.

Every trainer rank calls :meth:`WeightExporter.export` (or
:meth:`~WeightExporter.maybe_export` after each optimizer step). Data-parallel
replica 0 does the work: each pipeline stage's TP group gathers its buckets with
one collective per bucket, the stage's TP leader writes them into one of two
flat buffers, and stages other than the first send their buckets to the export
rank (pipeline stage 0, TP rank 0), which hands every bucket to the transport.
MoE experts: expert buckets are gathered, one collective each, by the stage's
expert-parallel group of expert-data-parallel rank 0 (which holds every expert
of the stage and contains the stage leader), whatever their dense DP rank; with
expert tensor parallelism by its expert-tensor-and-model-parallel group (ETP x
EP ranks: every shard of every expert of the stage).
While one buffer is on its way the other is being filled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time

import torch
import torch.distributed as dist

from ..sharding.fp8 import scale_name
from ..sharding.megatron import megatron_tensors
from ..sharding.mesh import MegatronMesh
from ..sharding.names import global_layer_names, unwrap
from ..sharding.spec import specs_from_model
from .. import copy_check
from ..copies import FlagsByName, copy_all
from .config import HOOK_TRANSPORTS, MAX_BUCKET_MB, MIN_BUCKET_MB, RefitConfig
from .engines.hf_model import hf_model_config
from .exec.gather import BucketGatherer, GatherGroup
from .plan.errors import NonFiniteWeights, PlanMismatch
from .plan.export_plan import ExportPlan, build_plan, members, unpack
from .plan.fp8 import quantize_blocks
from .transports import InProcessSender, make_sender

__all__ = ["ExportResult", "NonFiniteWeights", "WeightExporter"]

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """One export as seen by a trainer rank (``applied`` only on the export rank)."""

    version: int
    nbytes: int
    seconds: float
    num_buckets: int
    applied: tuple[int, ...] = ()

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class _FiniteCheck(FlagsByName):
    """Per-tensor "all finite" flags of one export, kept on the device and read once at its end.

    Every flag comes from a copy that moves the bytes anyway: the copies that place each bucket's pieces
    (into an export buffer or the engine's weights) flag NaN / Inf as they copy (:meth:`add`). A
    pipeline stage's leader places its own buckets, so it checks them there and sends the export rank its
    stage's flags (:meth:`stage_flags`), one small message at the end of the export, instead of the export
    rank reading the forwarded buckets again."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def stage_flags(self, names: list[str]) -> torch.Tensor:
        """This rank's flags as one int32 per tensor of ``names`` (a stage's tensors in plan order)."""
        out = torch.zeros(len(names), dtype=torch.int32, device=self.device)
        if self.flags:
            at = {n: i for i, n in enumerate(names)}
            index = torch.tensor([at[n] for n in self.names], dtype=torch.int64, device=self.device)
            flags = torch.cat([f.to(self.device, torch.int32) for f in self.flags])
            out.scatter_reduce_(0, index, flags, reduce="amax")
        return out


def _wait(pending: list, slot: int) -> None:
    """Wait for the send in flight from export buffer ``slot`` (if any) and clear it."""
    p, pending[slot] = pending[slot], None
    if p is not None:
        p.wait()


def auto_bucket_bytes(device: torch.device) -> int:
    """5% of free device memory, within 16..1024 MiB (64 MiB on CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(max(free * 0.05, MIN_BUCKET_MB * MiB), MAX_BUCKET_MB * MiB))
    return 64 * MiB


class WeightExporter:
    """Streams a Megatron-Core GPT model's weights, in HF naming, to receivers.

    ``receiver`` (a :class:`WeightReceiver`) is the target of
    ``transport="inprocess"``; ``sender`` overrides the transport entirely.
    Call :meth:`export` on every trainer rank.
    """

    def __init__(self, model, config: RefitConfig | None = None, *, receiver=None, sender=None):
        if config is not None and config.p2p:
            raise ValueError(
                "RefitConfig.transport='p2p' is the reshard refit (each engine rank receives its own shards): "
                "drive it with ReshardExecutor or TrainerRefit (docs/weight_export_reshard.md); WeightExporter "
                f"sends whole tensors over {HOOK_TRANSPORTS}"
            )
        # NTP DDP: a degraded replica takes its partner's weights after a step (collective over the pair).
        self._refresh = getattr(model, "refresh_compute_params", None)
        self.model = unwrap(model)
        self.config = config or RefitConfig()
        self.has_experts = bool(getattr(self.model.config, "num_moe_experts", None))
        self.mesh = m = MegatronMesh.current()
        # the plan's trainer sizes: experts split over EP and expert TP only in MoE models
        self.sizes = dict(tp=m.tp, ep=m.ep, etp=m.etp) if self.has_experts else dict(tp=m.tp, ep=1, etp=1)
        self.stage_leaders = (
            dist.get_process_group_ranks(m.pp_group)
            if m.pp_group is not None
            else [dist.get_rank() if dist.is_initialized() else 0]
        )
        # experts are gathered in the EP group, with expert TP in the ETP x EP group (its rank order is asked)
        self._expert_group = m.ep_group if m.etp == 1 else m.etp_ep_group
        self._expert_coords = [(r, 0) for r in range(m.ep)] if m.etp == 1 else None  # (ep, etp) of its ranks
        self.gathers_dense = m.dp_rank == 0
        self.gathers_experts = self.has_experts and m.edp_rank == 0
        self.participates = self.gathers_dense or self.gathers_experts
        self.is_leader = self.gathers_dense and m.tp_rank == 0
        self.is_export_rank = self.is_leader and m.pp_rank == 0
        if self.is_leader and self.has_experts and (m.ep_rank != 0 or m.etp_rank != 0 or not self.gathers_experts):
            raise RuntimeError(
                f"the stage leader (TP rank 0, DP rank 0) is EP rank {m.ep_rank}, expert-TP rank {m.etp_rank}, "
                f"expert-DP rank {m.edp_rank}; the MoE export needs it to be EP rank 0 and expert-TP rank 0 of "
                "expert-DP rank 0: use Megatron's default rank order (order='tp-cp-ep-dp-pp')"
            )
        self.device = next(self.model.parameters()).device
        if self.config.check_finite:  # the checked copies' kernel compiles while training runs
            copy_check.prewarm(self.device, {p.dtype for p in self.model.parameters()})
        self._receiver, self._sender = receiver, sender
        self._plan: ExportPlan | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._bucket_views: dict[int, tuple] = {}  # bucket index -> (buffer, gather dests, quantizations)
        self._facts = None
        self._signature = None
        self._buffers: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None  # FP8: the leader gathers quantized weights here
        self._gatherer = None
        self._direct_for = None
        self._auto_bucket_bytes: int | None = None
        self._hf_config: dict | None = None
        self.plans_built = 0
        self.version = 0
        self.last_result: ExportResult | None = None

    # ----------------------------------------------------------------- plan
    def _local_signature(self) -> str:
        h = hashlib.sha256()
        for n, p in self.model.named_parameters():
            h.update(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.data_ptr()};".encode())
        return h.hexdigest()

    @property
    def plan(self) -> ExportPlan:
        """The current plan (computed on first use: collective over every trainer rank the
        first time, as :meth:`export` is; afterwards over the PP group)."""
        self._agree_on_bucket_bytes()
        self._ensure_plan()
        return self._plan

    def _ensure_plan(self) -> None:
        m = self.mesh
        sig = self._local_signature()
        if sig == self._signature and m.pp == 1:
            return
        # Every stage's signature, global layers and specs check travel together, so every rank
        # rebuilds at the same time and learns why any stage cannot be exported.
        specs, layers, problem = self._stage_facts(sig)
        stages = [(sig, layers, problem)]
        if m.pp > 1:
            stages = [None] * m.pp
            dist.all_gather_object(stages, (sig, layers, problem), group=m.pp_group)
        problems = [f"stage {i}: {p}" for i, (_, _, p) in enumerate(stages) if p]
        if problems:
            raise PlanMismatch(f"the model cannot be exported: {'; '.join(problems)}")
        sig = "|".join(s for s, _, _ in stages)
        if sig == self._signature:
            return
        layer_stage = {layer: i for i, (_, ls, _) in enumerate(stages) for layer in ls}
        sizes = self.sizes
        self._plan = build_plan(
            specs,
            self.config.bucket_bytes or self._auto_bucket_bytes,
            pp=m.pp,
            **sizes,
            layer_stage=[layer_stage[i] for i in range(len(layer_stage))],
            quantize=self.config.quantize,
        )
        self._tensors = megatron_tensors(self.model)
        groups = {"tp": GatherGroup(m.tp_group, m.tp_rank, tuple(members("tp", m.pp_rank, **sizes)))}
        if self.gathers_experts:
            if self._expert_coords is None:  # once, collective over the expert group
                coords = [None] * dist.get_world_size(self._expert_group)
                dist.all_gather_object(coords, (m.ep_rank, m.etp_rank), group=self._expert_group)
                self._expert_coords = [tuple(c) for c in coords]
            rank = self._expert_coords.index((m.ep_rank, m.etp_rank))  # this rank's place in the expert group
            ranks = tuple(members("ep", m.pp_rank, **sizes, coords=self._expert_coords))
            groups["ep"] = GatherGroup(self._expert_group, rank, ranks)
        self._gatherer = BucketGatherer(self._tensors, groups, device=self.device)
        self._buffers, self._bucket_views, self._staging = [], {}, None
        self._signature = sig
        self.plans_built += 1
        if self.is_export_rank:
            log.info(
                "weight export plan: %d tensors, %.1f MiB in %d buckets of <= %.1f MiB",
                sum(1 for _ in self._plan.tensors()),
                self._plan.total_bytes / MiB,
                len(self._plan.buckets),
                self._plan.buffer_bytes / MiB,
            )

    def _stage_facts(self, sig: str):
        """``(specs, global layers, why it cannot be exported or None)`` of this rank's stage,
        read from the model once per local signature (PP jobs compare signatures every export)."""
        if self._facts is None or self._facts[0] != sig:
            vocab = self.config.vocab_size or getattr(self.model, "vocab_size", None)
            try:
                specs, problem = specs_from_model(self.model, vocab_size=vocab), None
            except ValueError as exc:
                specs, problem = None, f"{type(exc).__name__}: {exc}"
            layers = sorted(int(gp.split(".")[2]) for gp in global_layer_names(self.model).values())
            self._facts = (sig, (specs, layers, problem))
        return self._facts[1]

    # ------------------------------------------------------------ transport
    @property
    def hf_config(self) -> dict:
        """The model's Hugging Face config as a remote sender sends it with the plan (an engine started
        without a model builds its model from it): :func:`~.engines.hf_model.hf_model_config`, once."""
        if self._hf_config is None:
            vocab = self.config.vocab_size or getattr(self.model, "vocab_size", None)
            self._hf_config = hf_model_config(self.model, vocab_size=vocab)
        return self._hf_config

    @property
    def sender(self):
        if self._sender is None and self.is_export_rank:
            self._sender = make_sender(self)
        return self._sender

    @property
    def extra_memory_bytes(self) -> int:
        """Trainer memory the exporter holds: its buffers plus the TP gather scratch."""
        scratch = self._gatherer.scratch_bytes if self._gatherer else 0
        staging = 0 if self._staging is None else self._staging.numel()
        return sum(b.numel() for b in self._buffers) + scratch + staging

    # --------------------------------------------------------------- export
    def maybe_export(self, step: int) -> ExportResult | None:
        """Export after optimizer step ``step`` (1-based) every ``config.every_n_steps``."""
        return self.export(version=step) if self.config.due(step) else None

    @torch.no_grad()
    def export(self, version: int | None = None) -> ExportResult:
        """Stream the current weights; on the export rank returns the versions the
        receivers report as applied. Collective over the trainer's ranks."""
        self.version = self.version + 1 if version is None else version
        start = time.perf_counter()
        if self._refresh is not None:  # every rank: collective over its TP group
            self._refresh()
        self._agree_on_bucket_bytes()
        if not self.participates:
            return ExportResult(self.version, 0, 0.0, 0)
        self._ensure_plan()
        plan = self._plan
        sender = self.sender if self.is_export_rank else None
        if getattr(sender, "direct", False):  # the engine copies from the trainer's tensors itself
            if sender._info is None or self._direct_for != self._signature:
                transfers = [t for b in plan.buckets for t in b.transfers]
                sender.prepare(transfers, self._tensors)
                self._direct_for = self._signature
            sender.check_finite = self.config.check_finite  # in the engine's copy: no read of our own
            sender.start(plan, [], self.version)
        else:
            self._export_buckets(plan, sender)
        applied = tuple(sender.finish(self.version)) if sender is not None else ()
        nbytes = plan.total_bytes if self.is_export_rank else 0
        self.last_result = ExportResult(self.version, nbytes, time.perf_counter() - start, len(plan.buckets), applied)
        if self.is_export_rank:
            r = self.last_result
            log.info(
                "weight export: version %d, %.1f MB in %d buckets, %.1f ms, %.2f GB/s; receivers applied %s",
                r.version,
                r.nbytes / 1e6,
                r.num_buckets,
                r.seconds * 1e3,
                r.gbps,
                list(r.applied),
            )
        return self.last_result

    def _export_buckets(self, plan: ExportPlan, sender) -> None:
        # In-place senders write into the engine's tensors: the export rank needs buffers
        # only to receive other stages' buckets.
        push = getattr(sender, "push", False)
        if self.is_leader and not self._buffers and not (push and self.mesh.pp == 1):
            alloc = (
                sender.allocate
                if sender is not None and not push
                else (lambda n, d: torch.empty(n, dtype=torch.uint8, device=d))
            )
            self._buffers = [alloc(plan.buffer_bytes, self.device) for _ in range(2)]
        if sender is not None:
            sender.start(plan, self._buffers, self.version)
        pending = [None, None]
        # every stage leader checks the pieces it places; the export rank decides for the version
        check = _FiniteCheck(self.device) if self.config.check_finite and self.is_leader else None
        try:
            self._stream_buckets(plan, sender, pending, check)
            if check is not None:
                self._stage_flags(plan, check)
                if self.is_export_rank:
                    self._refuse_nonfinite(check)
        except BaseException:
            # Let in-flight sends finish or fail (each bounded by the timeout), so no
            # transfer is left writing into a buffer or blocking the group's teardown;
            # then the receivers drop the version (they keep the previous one).
            for slot in range(2):
                with contextlib.suppress(Exception):  # the first error is the one raised
                    _wait(pending, slot)
            if sender is not None:
                sender.abort(self.version)
            raise

    def _agree_on_bucket_bytes(self) -> None:
        """Set the automatic bucket size, the smallest over all trainer ranks (every rank that
        gathers a bucket must cut the plan the same way; free memory differs per GPU).
        Collective over the default group, once; nothing with ``bucket_size_mb`` set."""
        if self.config.bucket_size_mb is not None or self._auto_bucket_bytes is not None:
            return
        nbytes = auto_bucket_bytes(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([nbytes], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            nbytes = int(t.item())
        self._auto_bucket_bytes = nbytes

    def _views(self, bucket, out: torch.Tensor | None) -> tuple[dict[str, torch.Tensor] | None, list]:
        """Where the gather writes ``bucket``: its HF tensors as views of export buffer ``out``,
        FP8-quantized weights in the staging buffer instead; and the quantizations
        ``(staged, fp8 view, scale view)`` that then fill ``out``. Kept, so that the gatherer
        reuses the copies it built into them."""
        if out is None:
            return None, []
        hit = self._bucket_views.get(bucket.index)
        if hit is None or hit[0] is not out:
            dests = dict(unpack(bucket, out))
            jobs = []
            if bucket.staged and self._staging is None:  # one per plan, its largest bucket's staged bytes
                self._staging = torch.empty(self._plan.staging_bytes, dtype=torch.uint8, device=self.device)
            for t in bucket.staged:
                staged = t.view(self._staging)
                jobs.append((staged, dests[t.name], dests[scale_name(t.name)]))
                dests[t.name] = staged
            hit = self._bucket_views[bucket.index] = (out, dests, jobs)
        return hit[1], hit[2]

    def _stage_flags(self, plan: ExportPlan, check: _FiniteCheck) -> None:
        """The leaders of pipeline stages after the first send the export rank their stage's NaN/Inf flags
        (one int32 per tensor, plan order; one message each per export), which it adds to its own."""
        if self.mesh.pp == 1:
            return
        leaders, stage = self.stage_leaders, self.mesh.pp_rank
        for s in range(1, self.mesh.pp):
            names = list(dict.fromkeys(t.name for b in plan.buckets if b.pp_rank == s for t in b.tensors))
            if not names:
                continue
            if self.is_export_rank:
                flags = torch.empty(len(names), dtype=torch.int32, device=self.device)
                dist.recv(flags, src=leaders[s])
                check.add(names, flags)
            elif stage == s:
                dist.send(check.stage_flags(names), dst=leaders[0])

    def _refuse_nonfinite(self, check: _FiniteCheck) -> None:
        bad = check.bad()
        if bad:
            raise NonFiniteWeights.found(
                self.version,
                bad,
                "it was not published (the engines keep their version). Fix the training step (loss scale, "
                "learning rate, data), or pass check_finite=False / --no-refit-check-finite to export anyway",
            )

    def verify(self, tokens: torch.Tensor):
        """Run ``tokens`` through the Megatron model (every rank of the replica) and
        the first receiver; on the export rank return :class:`VerifyResult`."""
        from .engines.gate import megatron_logits, verify_export

        reference = megatron_logits(self.model, tokens)
        if not self.is_export_rank:
            return None
        sender = self.sender
        in_process = isinstance(sender, InProcessSender)
        got = sender.receiver.consumer.logits(tokens) if in_process else sender.request_logits(tokens)
        return verify_export(reference, got)

    def _stream_buckets(self, plan, sender, pending, check: _FiniteCheck | None = None) -> None:
        pp_rank, leaders = self.mesh.pp_rank, self.stage_leaders
        push = self.is_export_rank and getattr(sender, "push", False)
        for bucket in plan.buckets:
            slot = bucket.index % 2
            gathers = self.gathers_experts if bucket.group == "ep" else self.gathers_dense
            mine = bucket.pp_rank == pp_rank and gathers
            if not (mine or self.is_export_rank):
                continue
            out = None
            if self.is_leader:
                _wait(pending, slot)
                out = self._buffers[slot] if self._buffers else None
            if mine:
                dests, quantize = (sender.views, []) if push else self._views(bucket, out)
                bad = self._gatherer.gather(bucket, dests, check=check is not None)
                if bad is not None:  # the copies that placed the pieces flagged NaN / Inf
                    check.add(self._gatherer.placed(bucket), bad)
                for staged, q, scale in quantize:
                    quantize_blocks(staged, out=(q, scale))
            else:  # the export rank receives another stage's bucket
                dist.recv(out[: bucket.nbytes], src=leaders[bucket.pp_rank])
                if push:  # its stage leader checked it: a plain copy into the engine's weights
                    copy_all([(sender.views[name], t) for name, t in unpack(bucket, out)])
            if push:
                continue
            if self.is_export_rank:
                pending[slot] = sender.send(bucket, out)
            elif self.is_leader:
                pending[slot] = dist.isend(out[: bucket.nbytes], dst=leaders[0])
        last = plan.buckets[-1].index if plan.buckets else 0
        for slot in ((last + 1) % 2, last % 2):  # oldest first: acknowledgements come in order
            _wait(pending, slot)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
