"""Hot swap: a desired deployment becomes the models a pipeline answers with, without a
restart and without touching the hot path until the switch.

`ModelSwitcher.apply` runs on the control thread (`streams/control.py`): it looks each
version up (`models/registry.py`), loads it, validates it (its inputs resolve against
the pipeline's event fields and features, its task is the pipeline's, so the answer
schema holds) and warms it at every batch size, then hands a new `Serving` to the
pipeline in one reference swap; the next batch prepared takes it, batches in progress
finish with the old one. A version that fails any step is refused: logged, reported in
the heartbeat, and the pipeline keeps serving what it served. Retired models are closed
once no batch uses them.

`ModelSwitcher.guard`, called by the control thread between polls, checks each
candidate's guardrail (`streams/guardrail.py`) and returns the rollbacks to write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from models.errors import ModelError
from models.pool import SessionPool, warmup_sizes
from models.registry import resolve_model, with_version
from schemas.errors import HeadraceError
from streams import metrics
from streams.control import Desired, Report, worker_name
from streams.guardrail import breach
from streams.infer import Model
from streams.pipeline import Pipeline
from streams.serving import Serving

log = logging.getLogger(__name__)

# A batch takes its Serving and counts itself in it within microseconds; a retired
# model is closed only after its count stayed at zero this long.
_QUIET_S = 0.5
_RETIRE_WAIT_S = 120.0


@dataclass
class _Slot:
    pipeline: Pipeline
    fields: Sequence[str]
    refs: Sequence[str]
    versions: dict[str | None, Model]
    """Loaded models by registry version (None: the config's model)."""
    desired: Desired | None = None
    refused: dict[str, str] = field(default_factory=dict)
    since_s: float = 0.0
    """Monotonic time its `Serving` was installed: a guardrail judges answers from then."""
    rolled_back: int = -1
    """The revision whose candidate this worker rolled back (decided once)."""


class ModelSwitcher:
    """Applies desired deployments to the pipelines it was given (one thread at a time)."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self.worker = worker_name()

    def add(self, pipeline: Pipeline, fields: Sequence[str], refs: Sequence[str]) -> None:
        """A wired pipeline, serving its config's model."""
        self._slots[pipeline.config.name] = _Slot(pipeline, fields, refs, {None: pipeline.model})
        _export(pipeline.config.name, pipeline.serving, 1)

    @property
    def pipelines(self) -> list[str]:
        return list(self._slots)

    def apply(self, desired: Desired) -> bool:
        """Load what `desired` names and switch to it; False when refused. Blocks while
        versions load and warm up, and while retired models finish their batches."""
        with self._lock:
            slot = self._slots[desired.pipeline]
            started = slot.desired is None  # nothing applied yet: it serves its config's model
            slot.desired = desired
            old = slot.pipeline.serving
            serving = self._try(slot, desired.serving)
            refused = serving is None
            if serving is None and started and desired.previous != desired.serving:
                # The group kept serving what the refused deploy replaced: a worker started
                # since joins it, rather than answer with its config's model.
                serving = self._try(slot, desired.previous)
            if serving is None:  # traffic stays with the serving model
                serving = old.model
            # A candidate that cannot serve is refused alone: the serving part holds.
            candidate = None
            if desired.candidate is not None:
                candidate = self._try(slot, desired.candidate)
                refused = refused or candidate is None
            new = Serving(serving, candidate, desired.mode, desired.canary_percent)
            unchanged = (new.model, new.candidate, new.mode, new.canary_buckets) == (
                old.model, old.candidate, old.mode, old.canary_buckets,
            )  # fmt: skip
            if unchanged:
                return not refused
            slot.pipeline.use(new)
            slot.since_s = time.monotonic()
            metrics.MODEL_CHANGES.labels(desired.pipeline, "applied").inc()
            _export(desired.pipeline, old, 0)
            _export(desired.pipeline, new, 1)
            log.warning("pipeline %s: now serving %s (%s)", desired.pipeline, _describe(new),
                        desired.reason or "deploy")  # fmt: skip
            self._retire(slot, old)
            return not refused

    def _try(self, slot: _Slot, version: str | None) -> Model | None:
        """The loaded, validated, warm model of `version`; None when it is refused."""
        try:
            model = self._load(slot, version)
        except Exception as exc:  # an OSError (registry, full disk) refuses it too
            expected = isinstance(exc, HeadraceError)
            why = str(exc) if expected else f"{type(exc).__name__}: {exc}"
            slot.refused[str(version)] = why
            metrics.MODEL_CHANGES.labels(slot.pipeline.config.name, "refused").inc()
            log.error(
                "pipeline %s: version %s refused, serving %s: %s",
                slot.pipeline.config.name, version, _describe(slot.pipeline.serving), why,
                exc_info=not expected,
            )  # fmt: skip
            return None
        slot.refused.pop(str(version), None)  # it loads now (e.g. the registry was mended)
        return model

    def _load(self, slot: _Slot, version: str | None) -> Model:
        if version in slot.versions:
            return slot.versions[version]
        pipeline = slot.pipeline
        spec = pipeline.config
        config = spec.model if version is None else with_version(spec.model, version)
        config = resolve_model(config)
        started = time.monotonic()
        pool = SessionPool(config, warmup_sizes(spec.max_batch_size))
        try:
            model = Model(pool, slot.fields, slot.refs)
            task, serving_task = model.signature.output.task, pipeline.model.signature.output.task
            if task != serving_task:
                raise ModelError(
                    f"{model.signature.name} v{model.signature.version} answers a {task} "
                    f"task, the pipeline's answers are {serving_task}; hint: a new task "
                    "needs its own pipeline (its answer schema differs)"
                )
        except Exception:
            pool.close()
            raise
        log.info("pipeline %s: loaded %s v%s in %.1f s", spec.name, model.signature.name,
                 model.signature.version, time.monotonic() - started)  # fmt: skip
        slot.versions[version] = model
        return model

    def _retire(self, slot: _Slot, old: Serving) -> None:
        """Close the models `old` had that serve no more, once its batches are done."""
        deadline = time.monotonic() + _RETIRE_WAIT_S
        quiet_since = None
        while time.monotonic() < deadline:
            if old.in_use > 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= _QUIET_S:
                break
            time.sleep(0.05)
        self._close_unused(slot)

    def _close_unused(self, slot: _Slot) -> None:
        live = {id(model) for model in slot.pipeline.serving.models()}
        for version, model in list(slot.versions.items()):
            if id(model) not in live:
                del slot.versions[version]
                model.pool.close()

    def guard(self) -> list[Desired]:
        """The rollbacks the candidates' guardrails decide now, each logged and counted
        once: a candidate's answers since it was installed, over its rule's window,
        against the serving version's (called on the control thread)."""
        rollbacks = []
        with self._lock:
            for name, slot in self._slots.items():
                desired, serving = slot.desired, slot.pipeline.serving
                rule = desired.guardrail if desired is not None else None
                if rule is None or serving.candidate is None:
                    continue
                if slot.rolled_back == desired.revision:
                    continue
                start_s = max(time.monotonic() - rule.window_s, slot.since_s)
                found = breach(rule, serving.meter.since(start_s),
                               serving.candidate_meter.since(start_s))  # fmt: skip
                if found is None:
                    continue
                slot.rolled_back = desired.revision
                metrics.MODEL_ROLLBACKS.labels(name, found.reason).inc()
                metrics.MODEL_CHANGES.labels(name, "rolled_back").inc()
                log.error("pipeline %s: candidate v%s broke its guardrail (%s): %s; rolled "
                          "back", name, desired.candidate, found.reason, found.detail)  # fmt: skip
                rollbacks.append(desired.rollback(f"guardrail: {found.reason}: {found.detail}"))
        return rollbacks

    def reports(self) -> list[Report]:
        """What each pipeline serves now, for the heartbeat."""
        out = []
        for name, slot in self._slots.items():
            serving = slot.pipeline.serving
            candidate = serving.candidate
            out.append(Report(
                worker=self.worker, pipeline=name,
                serving=serving.model.signature.version,
                candidate=candidate.signature.version if candidate is not None else None,
                mode=serving.mode,
                canary_percent=slot.desired.canary_percent if serving.canary else 0.0,
                revision=slot.desired.revision if slot.desired else 0,
                refused=dict(slot.refused),
            ))  # fmt: skip
        return out

    def close(self) -> None:
        """Close every model loaded (closing a pool twice is harmless)."""
        for slot in self._slots.values():
            for model in slot.versions.values():
                model.pool.close()


def _export(pipeline: str, serving: Serving, value: int) -> None:
    """`headrace_serving_version_info` of each model of `serving` (1: serving now)."""
    roles = [("serving", serving.model)]
    if serving.candidate is not None:
        roles.append((serving.mode, serving.candidate))
    for role, model in roles:
        metrics.SERVING_VERSION.labels(pipeline, role, model.signature.version).set(value)


def _describe(serving: Serving) -> str:
    text = f"{serving.model.signature.name} v{serving.model.signature.version}"
    if serving.candidate is not None:
        percent = f" {serving.canary_buckets / 100:g}%" if serving.canary else ""
        text += f", candidate v{serving.candidate.signature.version} ({serving.mode}{percent})"
    return text
