"""Reshard refit between a trainer job and a separate engine job, over a :class:`~.control.refit_group.RefitGroup`.

Both sides build the same plan from the same two layouts (the trainer's at
refit ranks ``0..T-1``, the engine's at ``T..T+E-1``); the engine takes the
trainer's layout from the trainer (``src=None``: refit rank 0 publishes how to
build it, :attr:`~megatron_ext.sharding.Layout.recipe`)::

    # trainer job, every rank
    group = wx.RefitGroup.join(host, port, rank=dist.get_rank(), world_size=T + E, backend="nccl")
    src = wx.megatron_layout_from_groups(specs)   # read from parallel_state: ranks 0..T-1
    refit = wx.TrainerRefit(group, src, dst, wx.megatron_tensors(model))
    refit.refit(version)                    # after each optimizer step that should reach the engine
    refit.close()                           # the engine's serve() loop returns

    # engine job, every worker
    group = wx.RefitGroup.join(host, port, rank=T + engine_rank, world_size=T + E, backend="nccl")
    refit = wx.EngineRefit(group, None, dst, load_weights=model.load_weights)  # or tensors=<its own params>
    refit.refit()                           # waits for the trainer's next version, then loads it

The trainer's first refit rank announces each version through the store before
the bytes move; an engine rank that calls :meth:`EngineRefit.refit` without a
version takes the announced one, and one that names a version refuses any other
(:class:`~.plan.errors.RefitRejected`, reason ``"version"``, its tensors untouched).
Each rank plans only the transfers it sends or receives (``build_reshard_plan(rank=)``).
When the helpers are built, every rank checks that the two ends of each pair planned
alike and that all ranks run the same checks (:mod:`~.exec.agreement`, through the
store) and raises :class:`~.plan.errors.RefitRejected` (reason ``"plan"``) on every rank if not; a rank
whose tensors are not the layout's publishes why, and every rank raises
``"tensors"`` with that reason at once (nobody waits for the timeout).
After each refit an engine rank acknowledges the version it holds
(:meth:`TrainerRefit.engine_versions`), also after a failed one: the previous
version (atomic), or None once a streaming refit wrote a round. A version with a
NaN or Inf is refused (``"nonfinite"``) by the trainer rank that sent it and by the engine
ranks that received it (the flag travels in each bucket's header). Every wait is bounded
(:class:`~.control.refit_group.RefitGroupError` names the ranks that did not come).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from ..sharding.geometry import Layout
from ..sharding.spec import TensorSpec
from ..sharding.fp8 import fp8_layout
from ..sharding.megatron import layout_from_recipe
from .control import versions
from .control.refit_group import RefitGroup, RefitGroupError
from .engines.gate import RefitGate
from .engines.hf_model import hf_model_config
from .exec.reshard import RefitStats, ReshardExecutor
from .plan.errors import PlanMismatch
from .plan.fp8 import Fp8Sources, dequantized
from .plan.reshard_plan import ReshardPlan, build_reshard_plan

__all__ = ["EngineRefit", "TrainerRefit"]


class _RemoteRefit:
    def __init__(
        self,
        group: RefitGroup,
        src: Layout | None,
        dst,
        tensors: dict[str, torch.Tensor] | None,
        *,
        bucket_bytes: int,
        max_inflight: int,
        atomic: bool,
        check_finite: bool,
        memory_budget_bytes: int | None = None,
        atomic_staging: str = "device",
        memory_budget_strict: bool = True,
        zero_copy_bytes: int | None = None,
        refresh: Callable[[], None] | None = None,
        hf_config: dict | None = None,
    ):
        self.tag = group.next_tag("refit")
        self.trainer_hf_config = hf_config  # the engine side: what the trainer published (below)
        src, dst = self._exchange_trainer_layout(group, src, dst)
        if tensors is None:  # an engine rank's own tensors, allocated on its device
            tensors = {
                n: torch.empty(lt.shape, dtype=lt.dtype, device=group.device)
                for n, lt in dst.tensors.get(group.rank, {}).items()
            }
        outside = sorted(r for r in (*src.ranks, *dst.ranks) if not 0 <= r < group.world_size)
        if outside:
            raise ValueError(
                f"layout ranks {outside} are not refit ranks of this group (0..{group.world_size - 1}); "
                "build the layouts with ranks= the refit ranks (trainer 0..T-1, engine T..T+E-1)"
            )
        if not src.ranks:
            raise ValueError("the trainer layout has no ranks")
        self.group, self.src, self.dst, self.rank = group, src, dst, group.rank
        try:  # this rank's transfers: its share of the work
            self.plan, plan_problem = build_reshard_plan(src, dst, rank=self.rank), None
        except ValueError as exc:  # layouts no source completes: only ranks that touch the tensor see it
            self.plan = ReshardPlan(src, dst, [], rank=self.rank)
            plan_problem = f"{group.word} {self.rank}: {exc}"  # reported at the agreement: every rank raises at once
        self.executor = ReshardExecutor(
            self.plan,
            self.rank,
            tensors,
            group=group,
            bucket_bytes=bucket_bytes,
            atomic=atomic,
            max_inflight=max_inflight,
            check_finite=check_finite,
            memory_budget_bytes=memory_budget_bytes,
            atomic_staging=atomic_staging,
            memory_budget_strict=memory_budget_strict,
            zero_copy_bytes=zero_copy_bytes,
            refresh=refresh,
        )
        self.tensors = tensors
        self.announcer = min(src.ranks)  # the trainer rank that announces versions
        self.seq = 0  # refits so far: the same count on every rank
        self.executor.problem = self.executor.problem or self._model_problem() or plan_problem
        self.executor.agree(what="build its reshard plan")  # every rank runs the same plan, or all raise

    def _model_problem(self) -> str | None:
        """Why this rank's model cannot take the layout's tensors (None: it can); quoted on every rank."""
        return None

    def _exchange_trainer_layout(self, group: RefitGroup, src: Layout | None, dst) -> tuple[Layout, Layout]:
        """Refit rank 0 (a trainer rank) publishes how to build its layout (:attr:`Layout.recipe`), its
        specs and its model's Hugging Face config (``hf_config``, may be None); an engine rank given
        ``src=None`` builds the trainer's layout from them, and its own from the trainer's specs when
        ``dst`` is a function of them, so the engine never types the trainer's topology or model shape
        (:attr:`trainer_hf_config`: from that an HF engine may build its model)."""
        key = f"{self.tag}/src"
        if src is not None:
            model = src.base or src  # an FP8 layout publishes the model's specs and its FP8 recipe
            if group.rank == 0:
                specs = [s.to_json() for s in model.specs.values()]
                published = {"recipe": src.recipe, "specs": specs, "hf_config": self.trainer_hf_config}
                group.store.set(key, json.dumps(published))
            return src, dst(list(model.specs.values()), src) if callable(dst) else dst
        group.wait_keys([key], [0], what="publish the trainer's layout")
        published = json.loads(group.store.get(key).decode())
        self.trainer_hf_config = published.get("hf_config")
        if published["recipe"] is None:
            raise ValueError(
                "the trainer's layout was built by hand (no recipe to send); pass src= on the engine side too"
            )
        specs = [TensorSpec.from_json(s) for s in published["specs"]]
        src = layout_from_recipe(specs, published["recipe"])
        dst = dst(specs, src) if callable(dst) else dst
        if src.recipe["kind"] == "fp8-block" and dst.base is None:  # the trainer sends FP8: so does the plan
            dst = fp8_layout(dst, src.recipe["block"])
        return src, dst

    @property
    def version(self) -> int | None:
        """The version this rank's engine tensors hold (None: none accepted)."""
        return self.executor.version


class TrainerRefit(_RemoteRefit):
    """The trainer's side: every trainer rank builds one with its Megatron tensors
    (:func:`~.exec.reshard.megatron_tensors`) and calls :meth:`refit` for each version.

    ``src``: the trainer's layout (refit ranks ``0..T-1``); ``dst``: the engine's
    (refit ranks ``T..``); both built exactly as the engine builds them.
    ``refresh``: as the executor's (e.g. :meth:`~.plan.fp8.Fp8Sources.refresh`).
    ``hf_config``: the model's Hugging Face config
    (:func:`~.engines.hf_model.hf_model_config`; :meth:`from_model` passes it), published
    with the layout so that an HF engine without a model of its own builds one from it.
    """

    def __init__(
        self,
        group: RefitGroup,
        src: Layout,
        dst: Layout,
        tensors: dict[str, torch.Tensor],
        *,
        bucket_bytes: int = 64 << 20,
        max_inflight: int = 2,
        atomic: bool = True,
        check_finite: bool = True,
        memory_budget_bytes: int | None = None,
        atomic_staging: str = "device",
        memory_budget_strict: bool = True,
        zero_copy_bytes: int | None = None,
        refresh: Callable[[], None] | None = None,
        hf_config: dict | None = None,
    ):
        super().__init__(
            group,
            src,
            dst,
            tensors,
            bucket_bytes=bucket_bytes,
            max_inflight=max_inflight,
            atomic=atomic,
            check_finite=check_finite,
            memory_budget_bytes=memory_budget_bytes,
            atomic_staging=atomic_staging,
            memory_budget_strict=memory_budget_strict,
            zero_copy_bytes=zero_copy_bytes,
            refresh=refresh,
            hf_config=hf_config,
        )
        self._last: int | None = None  # the last refit's sequence number

    @classmethod
    def from_model(cls, model, config, *, vocab_size: int, device=None) -> "TrainerRefit":
        """Every trainer rank of a Megatron job (TP x PP x DP, EP) refitting a separate engine job as
        ``config`` (a :class:`~.config.RefitConfig` with ``transport='p2p'`` and ``store``) says: joins the
        refit group as refit rank ``dist.get_rank()`` of ``T + engine_tp * engine_dp``, reads the trainer's
        layout from the live groups and its specs from ``model`` (``vocab_size``: the HF vocabulary), and
        publishes both to the engine, with the model's Hugging Face config (an HF engine started without a
        model builds it from that). With ``quantize='fp8-block'`` it sends FP8 copies of the weights
        (:class:`~.plan.fp8.Fp8Sources`, requantized at every refit). Collective over the trainer's ranks and
        the engine's."""
        from ..sharding import megatron_layout_from_groups, megatron_tensors, specs_from_model

        if not config.p2p or config.store is None:
            raise ValueError(
                "TrainerRefit.from_model needs RefitConfig(transport='p2p', store='host:port') (--refit-transport "
                f"p2p --refit-store HOST:PORT), got transport={config.transport!r}, store={config.store!r}"
            )
        if callable(getattr(model, "refresh_compute_params", None)):
            raise ValueError(
                "a nonuniform-TP trainer refits through ntp_megatron_layout / ntp_megatron_tensors with "
                "refresh=ddp.refresh_compute_params (docs/weight_export_reshard.md); from_model reads uniform groups"
            )
        trainer = dist.get_world_size()
        engine = config.engine_tp * config.engine_dp
        specs = specs_from_model(model, vocab_size=vocab_size)
        src = config.wire_layout(megatron_layout_from_groups(specs))
        dst = config.wire_layout(config.engine_layout(specs, ranks=range(trainer, trainer + engine)))
        tensors, refresh = megatron_tensors(model), None
        if src.base is not None:  # FP8: the executor sends copies quantized before every refit
            sources = Fp8Sources(tensors, src, dist.get_rank())
            tensors, refresh = sources.tensors, sources.refresh
        hf_config = hf_model_config(model, vocab_size=vocab_size) if dist.get_rank() == 0 else None  # rank 0 publishes
        group = config.join(dist.get_rank(), trainer + engine, device=device)
        return cls(group, src, dst, tensors, refresh=refresh, hf_config=hf_config, **config.executor_kwargs)

    def _announce(self, value: str) -> None:
        if self.rank == self.announcer:
            self.group.store.set(f"{self.tag}/v/{self.seq}", value)

    def refit(self, version: int, *, source_version: int | dict[str, int | None] | None = None) -> RefitStats:
        """Announce ``version`` to the engine and send this rank's share of it (every trainer rank calls it).
        ``source_version``: as :meth:`~.exec.reshard.ReshardExecutor.refit` (the version the bytes really hold)."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        self._announce(versions.announcement(version))
        seq, self.seq = self.seq, self.seq + 1
        self._last = seq
        return self.executor.refit(version, source_version=source_version)

    def engine_versions(self, timeout_s: float | None = None) -> dict[int, int | None]:
        """After :meth:`refit`: the version each engine rank holds once it finished (and loaded) that refit
        (None: none accepted). A rank that refused keeps its previous version; a streaming rank whose refit
        failed after its first write holds None. Bounded by ``timeout_s``."""
        seq = self._last
        if seq is None:
            raise RuntimeError("engine_versions() needs a refit() first")
        ranks = list(self.dst.ranks)
        keys = [f"{self.tag}/ack/{seq}/{r}" for r in ranks]
        self.group.wait_keys(keys, ranks, what=f"acknowledge refit {seq}", timeout_s=timeout_s)
        return {r: versions.acked(v) for r, v in zip(ranks, self.group.store.multi_get(keys))}

    def close(self, timeout_s: float | None = None) -> None:
        """Tell the engine that no more versions come (its :meth:`EngineRefit.serve` returns) and wait, up
        to ``timeout_s``, until every engine rank has seen it (refit rank 0 hosts the store: it must outlive
        the engine's last read)."""
        self._announce(versions.announcement(None))
        seq, self.seq = self.seq, self.seq + 1
        ranks = list(self.dst.ranks)
        self.group.wait_keys(
            [f"{self.tag}/ack/{seq}/{r}" for r in ranks], ranks, what="see the refit's close", timeout_s=timeout_s
        )


class EngineRefit(_RemoteRefit):
    """The engine's side: join the refit group, then :meth:`refit` each time the trainer announces a version.

    ``tensors``: the engine's own local tensors under the layout's names
    (vLLM-style ``qkv_proj`` / ``gate_up_proj`` shards), written in place; None
    allocates them on ``group.device``. ``load_weights``: called after each
    accepted version with the rank's whole HF tensors
    (``dst.hf_tensors(rank, tensors)``, views into ``tensors``), e.g. a vLLM or
    HF model's ``load_weights``; a TP-sharded tensor is not whole, so with
    engine TP > 1 write in place instead (pass the engine's tensors).
    ``dequantize``: when the trainer sends FP8 (``--refit-quantize fp8-block``),
    hand ``load_weights`` the weights dequantized to the model's dtype (an engine
    that loads plain checkpoints, e.g. a Hugging Face model) instead of the FP8
    values and their ``weight_scale_inv`` (an FP8 engine such as vLLM's block-FP8).
    ``expected``: the model's ``(shape, dtype)`` per HF name (e.g.
    ``HFModelConsumer.expected_tensors()``); a tensor the model does not hold
    as the trainer sends it is refused on every rank at the plan check, naming it.
    ``dst`` may be a function of the trainer's specs and layout (with ``src=None``:
    both layouts then come from what the trainer publishes, e.g. ``lambda specs,
    trainer: inference_layout(specs, tp=1, dp=E, ranks=range(len(trainer.ranks), ...))``).
    ``consumer``: instead of ``load_weights`` and ``expected``, an object with
    ``load_weights`` and ``expected_tensors()`` (:class:`~.engines.receiver.HFModelConsumer`);
    one with ``configure(hf_config)`` (:class:`~.engines.hf_model.HFModelFromTrainer`) first
    builds its model from the Hugging Face config the trainer published (:attr:`trainer_hf_config`),
    or says why it cannot, which every rank of both jobs then raises at the plan check.
    """

    def __init__(
        self,
        group: RefitGroup,
        src: Layout | None,
        dst: Layout | Callable[[list[TensorSpec], Layout], Layout],
        tensors: dict[str, torch.Tensor] | None = None,
        *,
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        consumer=None,
        dequantize: bool = False,
        bucket_bytes: int = 64 << 20,
        max_inflight: int = 2,
        atomic: bool = True,
        check_finite: bool = True,
        memory_budget_bytes: int | None = None,
        atomic_staging: str = "device",
        memory_budget_strict: bool = True,
        zero_copy_bytes: int | None = None,
    ):
        if consumer is not None:
            if load_weights is not None or expected is not None:
                raise ValueError("EngineRefit: pass consumer= or load_weights= / expected=, not both")
            load_weights = consumer.load_weights
        self.load_weights, self.expected, self.dequantize = load_weights, expected, dequantize
        self.consumer = consumer
        super().__init__(
            group,
            src,
            dst,
            tensors,
            bucket_bytes=bucket_bytes,
            max_inflight=max_inflight,
            atomic=atomic,
            check_finite=check_finite,
            memory_budget_bytes=memory_budget_bytes,
            atomic_staging=atomic_staging,
            memory_budget_strict=memory_budget_strict,
            zero_copy_bytes=zero_copy_bytes,
        )

    def _model_problem(self) -> str | None:
        if self.consumer is not None and self.rank in self.dst.ranks:
            configure = getattr(self.consumer, "configure", None)
            if callable(configure):  # the engine's model, built from the trainer's config
                try:
                    configure(self.trainer_hf_config)
                except PlanMismatch as exc:
                    return f"engine refit rank {self.rank}: {exc}"
            self.expected = self.consumer.expected_tensors()
        if self.expected is None or self.rank not in self.dst.ranks:
            return None
        model = self.dst.base if self.dequantize and self.dst.base is not None else None
        for name, t in self.dst.hf_tensors(self.rank, self.tensors):
            dtype = t.dtype
            if model is not None:  # FP8 dequantized: the model gets the trainer's dtype, and no scales
                if name not in model.specs:
                    continue
                dtype = model.specs[name].dtype
            want = self.expected.get(name)
            if want is None or (tuple(want[0]), want[1]) != (tuple(t.shape), dtype):
                has = "has no such tensor" if want is None else f"holds {tuple(want[0])} {want[1]}"
                return (
                    f"engine refit rank {self.rank}: {name}: the trainer sends {tuple(t.shape)} {dtype}, the "
                    f"engine's model {has} (start the engine with the trainer's model and dtype)"
                )
        return None

    def _loaded(self):
        """``(HF name, tensor)`` of what this rank hands ``load_weights`` (FP8 dequantized when asked)."""
        pairs = self.dst.hf_tensors(self.rank, self.tensors)
        if self.dequantize and self.dst.base is not None:
            dtype = next(iter(self.dst.base.specs.values())).dtype
            return dequantized(pairs, dtype)
        return pairs

    def next_version(self, timeout_s: float | None = None) -> int | None:
        """Wait for the trainer's next announcement: a version, or None when the trainer closed."""
        key = f"{self.tag}/v/{self.seq}"
        self.group.wait_keys([key], [self.announcer], what=f"announce refit {self.seq}", timeout_s=timeout_s)
        return versions.announced(self.group.store.get(key))

    def refit(
        self, version: int | None = None, *, timeout_s: float | None = None, verify: RefitGate | None = None
    ) -> RefitStats:
        """Receive the trainer's next version and load it.

        Waits up to ``timeout_s`` (default: the group's) for the trainer's
        announcement. ``version=None`` takes the announced version; a given
        version refuses any other (:class:`~.plan.errors.RefitRejected`, reason
        ``"version"``, tensors untouched; still in step with the trainer).
        ``verify``: a :class:`~.engines.gate.RefitGate`, as in the executor. A refit
        that fails still acknowledges what the rank holds, if the trainer's
        store is still there (else the refit's own error is raised).
        """
        announced = self.next_version(timeout_s)
        if announced is None:
            raise RefitGroupError(f"refit rank {self.rank}: the trainer closed the refit (no version {self.seq})")
        want = announced if version is None else version
        seq, self.seq = self.seq, self.seq + 1
        try:
            stats = self.executor.refit(want, verify=verify)
            if self.load_weights is not None and self.rank in self.dst.ranks:
                try:
                    self.load_weights(self._loaded())
                except BaseException:
                    self.executor.version = None  # the engine's model holds no complete version
                    raise
        except BaseException:
            try:  # say what this rank holds now (None after a streaming refit that died midway)
                self._ack(seq)
            except (RuntimeError, dist.DistError):
                pass  # the store went with the trainer: the refit's own error is the one to raise
            raise
        self._ack(seq)
        return stats

    def serve(
        self,
        on_version: Callable[[RefitStats], object] | None = None,
        *,
        timeout_s: float | None = None,
        verify: RefitGate | None = None,
    ) -> int | None:
        """Refit every announced version until the trainer closes; returns the last version held.
        ``timeout_s`` bounds the wait for each announcement (the trainer's time between refits).
        ``verify``: as :meth:`refit`'s, run at every version; a gate built with ``on_fail="raise"``
        ends the loop at the first version it fails (:class:`~.plan.errors.RefitRejected`, reason
        ``"gate"``), one with ``"report"`` carries on (``stats.gate_ok`` in ``on_version``)."""
        while True:
            if self.next_version(timeout_s) is None:
                self._ack(self.seq)
                self.seq += 1
                return self.version
            stats = self.refit(timeout_s=timeout_s, verify=verify)
            if on_version is not None:
                on_version(stats)

    def _ack(self, seq: int) -> None:
        store = self.group.store
        store.set(f"{self.tag}/ack/{seq}/{self.rank}", versions.ack(self.version))
        # Keep the previous refit's ack: a trainer rank may still read it (engine_versions) while the
        # first trainer rank already announced the next version (e.g. close()). Two refits back, every
        # trainer rank has moved on: the next refit needs all of them.
        if seq >= 2:
            store.delete_key(f"{self.tag}/ack/{seq - 2}/{self.rank}")
