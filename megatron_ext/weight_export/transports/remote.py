"""What every sender to another process shares: one control connection per engine
(:mod:`..control.channel`) carrying the plan (with the model's Hugging Face config, from which an
engine without a model of its own builds one: :mod:`..engines.hf_model`), version begin/end/abort
(answered with the version the engine holds, :mod:`..control.versions`) and the verifier's tokens and
logits."""

from __future__ import annotations

import torch

from ..control import channel as control
from ..control import versions
from ..control.channel import ControlError
from ..plan.errors import NonFiniteWeights, ReceiverError
from ..plan.export_plan import ExportPlan, PlanMismatch

_ABORT_WAIT_S = 5.0  # how long a trainer waits for an engine to confirm a dropped version


class _RemoteSender:
    hf_config: dict | None = None  # sent with the plan (:func:`~..engines.hf_model.hf_model_config`; make_sender)

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        if not addresses:
            raise ValueError("addresses must name at least one receiver endpoint 'host:port'")
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.chans: list[control.Channel] = []
        try:
            for a in self.addresses:
                self.chans.append(control.connect(a, timeout_s=timeout_s, key=authkey, what="weight receiver"))
        except ControlError as exc:
            self.close()
            raise ReceiverError(
                f"{exc}; start the engine's weight receiver (weight_export.serve) first or fix --refit-target"
            ) from exc
        self._fingerprint = None

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _transport_info(self, buffers) -> dict:
        return {}

    def _expect(self, i: int, kind: str, what: str, timeout_s: float | None = None) -> control.Message:
        ch, address = self.chans[i], self.addresses[i]
        try:
            msg = ch.recv(self.timeout_s if timeout_s is None else timeout_s)
        except ControlError as exc:
            raise ReceiverError(
                f"receiver at {address} died or hung while {what} ({exc}); see the engine's log, "
                "then restart it and export again"
            ) from exc
        if msg.kind == "refuse":
            raise PlanMismatch(f"receiver at {address} refused the plan: {msg['reason']}")
        if msg.kind == "error":
            raise ReceiverError(f"receiver at {address} failed while {what}: {msg['reason']}")
        if msg.kind != kind:
            raise ReceiverError(f"receiver at {address} sent {msg.kind!r}, expected {kind!r} while {what}")
        return msg

    def _send_all(self, kind: str, what: str, **fields) -> None:
        for ch, address in zip(self.chans, self.addresses):
            try:
                ch.send(kind, **fields)
            except ControlError as exc:
                raise ReceiverError(f"receiver at {address} died while {what} ({exc})") from exc

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self._send_all(
                "plan",
                "sending the plan",
                plan=plan.to_wire(),
                info=self._transport_info(buffers),
                hf_config=self.hf_config,
            )
            for i in range(len(self.chans)):
                self._expect(i, "ready", "checking the plan")
            self._fingerprint = plan.fingerprint
        self._send_all("begin", f"starting version {version}", version=version, **self._begin_fields())

    def _begin_fields(self) -> dict:
        """What a version's ``begin`` message tells the engines besides the version."""
        return {}

    def finish(self, version: int) -> list[int]:
        """End ``version``; the version each engine then holds. Raises :class:`NonFiniteWeights`
        when an engine found NaN / Inf while it copied the version (``ipc-direct``)."""
        self._send_all("end", f"finishing version {version}", version=version)
        replies = [self._expect(i, versions.HOLDS, f"applying version {version}") for i in range(len(self.chans))]
        for address, msg in zip(self.addresses, replies):
            bad = msg.fields.get("nonfinite")
            if bad:
                raise NonFiniteWeights.found(
                    version,
                    bad,
                    f"the engine at {address} found them as it copied the version into its weights and holds "
                    f"{versions.describe(msg['version'])}. Fix the training step (loss scale, learning rate, "
                    "data) and export again, or pass check_finite=False / --no-refit-check-finite to export anyway",
                )
        return [msg["version"] for msg in replies]

    def abort(self, version: int) -> list[int | None]:
        """Tell every receiver that ``version`` will not complete; returns the version each
        still holds (None: none complete, or no answer). Best effort and short: a receiver that is
        gone, or still waiting for a bucket that will not come, is skipped after a few seconds (it
        drops the version itself when this trainer closes)."""
        held = []
        for i, ch in enumerate(self.chans):
            try:
                ch.send("abort", version=version)
                held.append(
                    self._expect(i, versions.HOLDS, f"aborting version {version}", min(self.timeout_s, _ABORT_WAIT_S))[
                        "version"
                    ]
                )
            except (ControlError, PlanMismatch):
                held.append(None)
        return held

    def request_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the first receiver's model for ``tokens`` (for :func:`verify_export`)."""
        meta, blob = control.tensor_blob(tokens)
        try:
            self.chans[0].send("forward", tokens=meta, blobs=[blob])
        except ControlError as exc:
            raise ReceiverError(f"receiver at {self.addresses[0]} died while computing logits ({exc})") from exc
        msg = self._expect(0, "logits", "computing logits")
        return control.blob_tensor(msg["logits"], msg.blobs[0])

    def close(self) -> None:
        for ch in self.chans:
            try:
                ch.send("close")
            except ControlError:
                pass
            ch.close()
        self.chans = []
