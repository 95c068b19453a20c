"""Hot swap: a desired deployment becomes the models a pipeline answers with, without a
restart and without touching the hot path until the switch.

`ModelSwitcher.apply` runs on the control thread (`streams/control.py`): it looks each
version up (`models/registry.py`), loads it, validates it (its inputs resolve against
the pipeline's event fields and features, its task is the pipeline's, so the answer
schema holds) and warms it at every batch size, then hands a new `Serving` to the
pipeline in one reference swap; the next batch prepared takes it, batches in progress
finish with the old one. A version that fails any step is refused: logged, reported in
the heartbeat, and the pipeline keeps serving what it served. A deploy that fails in any
later step (building or installing the switch) is refused whole the same way: what served
before serves on, and what was loaded for it is closed. Retired models are closed once no
batch uses them, and their versions' series are removed from the metrics (a worker deployed
many times would otherwise export every version it ever served).

`ModelSwitcher.guard`, called by the control thread between polls, checks each
candidate's guardrail (`streams/guardrail.py`) and returns the rollbacks to write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

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
    """The desired state its `Serving` was built from."""
    revision: int = 0
    """The revision last acted on: applied, or refused (then newer than `desired`'s)."""
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
        _export(pipeline.config.name, pipeline.serving, pipeline.serving)

    @property
    def pipelines(self) -> list[str]:
        return list(self._slots)

    def apply(self, desired: Desired) -> bool:
        """Load what `desired` names and switch to it; False when refused. Blocks while
        versions load and warm up, and while retired models finish their batches."""
        with self._lock:
            slot = self._slots[desired.pipeline]
            applied, old = slot.desired, slot.pipeline.serving
            slot.revision = desired.revision
            new = None
            try:
                new, refused = self._prepare(slot, desired)
                if new is not None:
                    self._install(slot, desired, old, new)
            except Exception as exc:  # whatever step failed, nothing of it may stay half done
                self._undo(slot, desired, applied, old, new, exc)
                return False
            if new is not None:
                self._retire(slot, old)
            return not refused

    def _prepare(self, slot: _Slot, desired: Desired) -> tuple[Serving | None, bool]:
        """The `Serving` `desired` asks for, as far as its versions load (None: the one
        installed now), and whether a version was refused."""
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
        return (None if unchanged else new), refused

    def _install(self, slot: _Slot, desired: Desired, old: Serving, new: Serving) -> None:
        slot.pipeline.use(new)
        slot.since_s = time.monotonic()
        _export(desired.pipeline, old, new)
        metrics.MODEL_CHANGES.labels(desired.pipeline, "applied").inc()
        log.warning("pipeline %s: now serving %s (%s)", desired.pipeline, _describe(new),
                    desired.reason or "deploy")  # fmt: skip

    def _undo(
        self,
        slot: _Slot,
        desired: Desired,
        applied: Desired | None,
        old: Serving,
        new: Serving | None,
        exc: Exception,
    ) -> None:
        """`desired` failed after its versions loaded: `old` serves on, what was loaded
        for it is closed, and it is reported refused like a version that did not load."""
        name = desired.pipeline
        slot.desired = applied  # the guardrail and the report follow what serves
        if slot.pipeline.serving is not old:
            tried = slot.pipeline.serving
            slot.pipeline.use(old)
            _export(name, tried, old)
            self._retire(slot, tried)  # its batches finish with it
        else:
            self._close_unused(slot)
        refused = desired.candidate if desired.candidate is not None else desired.serving
        why = f"applying revision {desired.revision} failed: {type(exc).__name__}: {exc}"
        slot.refused[str(refused)] = why
        metrics.MODEL_CHANGES.labels(name, "refused").inc()
        log.error("pipeline %s: revision %d refused, serving %s: %s", name, desired.revision,
                  _describe(old), why, exc_info=True)  # fmt: skip

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
        """Close the models that answer no more and remove their versions' series."""
        live = slot.pipeline.serving.models()
        live_ids = {id(model) for model in live}
        for version, model in list(slot.versions.items()):
            if id(model) not in live_ids:
                del slot.versions[version]
                try:
                    model.pool.close()
                except Exception:  # the switch is done: one pool must not keep the others open
                    log.exception("pipeline %s: closing retired v%s failed",
                                  slot.pipeline.config.name, version)  # fmt: skip
        slot.pipeline.retire_meters({model.signature.version for model in live})

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
                rollback = desired.rollback(f"guardrail: {found.reason}: {found.detail}")
                if rollback.revision <= slot.revision:  # a later revision was refused whole
                    rollback = replace(rollback, revision=slot.revision + 1)
                rollbacks.append(rollback)
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
                revision=slot.revision,
                refused=dict(slot.refused),
            ))  # fmt: skip
        return out

    def close(self) -> None:
        """Close every model loaded (closing a pool twice is harmless)."""
        for slot in self._slots.values():
            for model in slot.versions.values():
                model.pool.close()


def _export(pipeline: str, before: Serving, after: Serving) -> None:
    """`headrace_serving_version_info` at 1 for each (role, version) of `after`; those
    only `before` had are removed, not left at 0 (one series per version ever served)."""
    now = _roles(after)
    for role, version in _roles(before) - now:
        metrics.remove(metrics.SERVING_VERSION, pipeline, role, version)
    for role, version in now:
        metrics.SERVING_VERSION.labels(pipeline, role, version).set(1)


def _roles(serving: Serving) -> set[tuple[str, str]]:
    roles = {("serving", serving.model.signature.version)}
    if serving.candidate is not None:
        roles.add((serving.mode, serving.candidate.signature.version))
    return roles


def _describe(serving: Serving) -> str:
    text = f"{serving.model.signature.name} v{serving.model.signature.version}"
    if serving.candidate is not None:
        percent = f" {serving.canary_buckets / 100:g}%" if serving.canary else ""
        text += f", candidate v{serving.candidate.signature.version} ({serving.mode}{percent})"
    return text
