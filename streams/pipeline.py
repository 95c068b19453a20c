"""One pipeline's stages applied to a micro-batch: route (admission), read features,
infer, encode and publish. Decoding happened before batching (`streams/decode.py`), so
every item arrives with its event (or its error) and its deadline.

Between `prepare` and `read_features` the runner has `route` decide each event's path
(`streams/admit.py`), so no feature or model work is spent on an event that cannot use
it; it may revise the full-path events again before `infer`, which runs the full and
the fallback model once each. The stages are independent of any consumer so that the
runner can overlap them across batches and the benchmarks can drive them without one.
`publish` returns once every input of the batch has exactly one outcome durably written
to Kafka (an OK, DEGRADED or SHED answer, or a dead-letter record), and raises if it
could not write them all: the caller must not acknowledge the batch then. Outcome
counters move only after that.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from features.cache import FeatureCache
from features.errors import StoreUnavailable
from features.lookup import FeatureLookup, FeatureRows
from models.errors import ModelError
from models.signature import Signature
from streams import metrics
from streams.admit import NON_FINITE, Admission, Candidate, Estimates, Route
from streams.config import PipelineConfig
from streams.encode import AnswerEncoder
from streams.errors import ConfigError
from streams.guardrail import VersionMeter
from streams.infer import Model
from streams.outgoing import Outgoing, dead_letter, mark_redelivered
from streams.publish import Publisher
from streams.records import Item, OutRecord
from streams.serving import Serving
from streams.tracing import NO_BATCH, NO_TRACING, NoTracing, Tracing

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A released batch on its way through the stages."""

    items: Sequence[Item]
    """Every input of the batch, in order (dead letters included)."""
    admitted: list[Item] = field(default_factory=list)
    """The inputs that decoded, to be answered."""
    rows: FeatureRows | None = None
    timings: dict[str, int] = field(default_factory=dict)
    run_seconds: dict[Route, float] = field(default_factory=dict)
    """Seconds of each model run (full, fallback) of the batch."""
    to_run: dict[Route, list[Item]] | None = None
    """The events of each model run (full, fallback) not done yet, taken at the first
    attempt of `infer`: a retry runs only these (None: not attempted)."""
    canary_runs: dict[str, float | None] = field(default_factory=dict)
    """Of a canary batch's full run, the parts done and their seconds: the serving
    version's share, the candidate's (None: it failed), the serving version's run on
    the canary's share after a failure ("again")."""
    rescue_seconds: float = 0.0
    """Seconds of the fallback model's run on the full model's NaN or infinite answers:
    those events' inference time, kept out of `run_seconds` (the estimator's)."""
    outgoing: Outgoing | None = None
    """Its outcome records once encoded, with what Kafka acknowledged of them."""
    serving: Serving | None = None
    """The models that answer it, read once when it was prepared."""
    candidate_seconds: float = 0.0
    """Seconds of the canary candidate's run, where some of its events took it."""
    trace: Any = NO_BATCH
    """Its spans (`streams/tracing.py`), `NO_BATCH` with tracing off."""
    outcome_items: Sequence[Item] = ()
    """The inputs that get an outcome: all of them, except any answered before."""

    def count(self, route: Route) -> int:
        return sum(1 for item in self.admitted if item.route is route)


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        admission: Admission,
        lookup: FeatureLookup | None,
        model: Model,
        encoder: AnswerEncoder,
        publisher: Publisher,
        measure: metrics.PipelineMetrics,
        fallback: Model | None = None,
        clock: Callable[[], float] = time.time,
        tracing: Tracing | NoTracing = NO_TRACING,
    ) -> None:
        self.config = config
        self._tracing = tracing
        self.admission = admission
        self._meters: dict[str, VersionMeter] = {}
        self.metrics = measure
        self.serving = Serving(model)
        self.use(self.serving)
        self.fallback = fallback
        self._lookup = lookup
        self._encoder = encoder
        self._publisher = publisher
        self._clock = clock
        output = model.signature.output
        problems = task_problems(config, model.signature, fallback and fallback.signature)
        if problems:
            raise ConfigError(problems[0])
        default = config.degradation.default_score
        self._default_answer = None if default is None else output.fixed(default)
        self._shed_answer = output.unanswered()
        self._answer_fields = self._identity_of(model)
        # The feature cache's LRU and age bound serve answers too (value: the answer).
        answers = config.degradation.answer_cache
        self._answers = FeatureCache(answers.max_entries, answers.max_age_s, clock)
        self._cached_for = self.serving
        timeout_ms = config.degradation.store_timeout_ms or config.latency_budget_ms / 2
        self._store_timeout_s = timeout_ms / 1000
        models = {"full": model} if fallback is None else {"full": model, "fallback": fallback}
        measure.describe(
            config.latency_budget_ms / 1000,
            {role: (m.signature.name, m.signature.version) for role, m in models.items()},
        )

    @property
    def model(self) -> Model:
        """The serving model now."""
        return self.serving.model

    def use(self, serving: Serving) -> None:
        """Answer the batches prepared from now on with `serving` (callable from any
        thread: one reference replaced; a batch in progress keeps its own)."""
        serving.meter = self._meter(serving.model)
        if serving.candidate is not None:
            serving.candidate_meter = self._meter(serving.candidate)
        before, after = self.serving.model.signature, serving.model.signature
        self.metrics.switched("full", (before.name, before.version), (after.name, after.version))
        self.serving = serving

    def _identity_of(self, model: Model) -> tuple[str, ...]:
        """The fields of an input identical for `model`'s answer cache: the entity keys
        and the event inputs of that model (a version may read other fields)."""
        return tuple(dict.fromkeys([*self.config.entity_fields.values(), *model.event_sources]))

    def _meter(self, model: Model) -> VersionMeter:
        """The meter of `model`'s version, bound once per version (again after it retired:
        counting starts over, a counter reset to Prometheus)."""
        version = model.signature.version
        if version not in self._meters:
            self._meters[version] = VersionMeter(self.config.name, version)
        return self._meters[version]

    def retire_meters(self, live: set[str]) -> None:
        """Forget the meters of versions not in `live` and remove their series: versions
        that left the pipeline, whose batches are done (a worker deployed many times
        would otherwise keep and export every version it ever served)."""
        for version in [version for version in self._meters if version not in live]:
            self._meters.pop(version).retire()

    def done(self, prepared: Prepared) -> None:
        """A batch's outcomes are written: its models may retire once no batch uses them."""
        prepared.serving.in_use -= 1

    def prepare(self, items: Sequence[Item]) -> Prepared:
        """A released batch: every decoded event starts on the full path, for the
        runner's admission (`route`) to decide."""
        prepared = Prepared(items, trace=self._tracing.batch(items), outcome_items=items)
        now_s = self._clock()  # Kafka timestamp to admission: Kafka, consumer, batcher
        metrics.observe_many(
            self.metrics.admission_lag,
            [max(0.0, now_s - item.record.timestamp_ms / 1000) for item in items],
        )
        serving = prepared.serving = self.serving
        serving.in_use += 1
        if serving is not self._cached_for:  # another model answers: forget the old answers
            self._answers.clear()
            self._cached_for = serving
            self._answer_fields = self._identity_of(serving.model)
        use_cache = self.admission.ladder.answer_cache
        answered_before = redelivered = 0
        for item in items:
            if item.answered_before:
                answered_before += 1
                continue
            redelivered += item.redelivered
            if item.error is not None:
                continue
            item.route = Route.FULL
            if use_cache:
                event = item.event
                item.cache_key = tuple(event[name] for name in self._answer_fields)
                cached = self._answers.get(item.cache_key)
                item.cached = None if cached is None else cached[0]
            prepared.admitted.append(item)
        if answered_before:
            prepared.outcome_items = [item for item in items if not item.answered_before]
            self.metrics.answered_before.inc(answered_before)
        if redelivered:
            self.metrics.redelivered.inc(redelivered)
        prepared.timings = {
            "batch_size": len(items),
            "decode_us": max((item.decode_us for item in items), default=0),
        }
        return prepared

    def route(
        self, items: Sequence[Item], estimates: Estimates, features_read: bool = False
    ) -> None:
        """Decide, or revise, the route of each item (in batch order) by its deadline.
        Once the features are read, an item sent to a fallback model that reads the store
        has no row unless the full model read one for it: it takes the rungs after."""
        candidates = [
            Candidate(item.deadline_s, item.priority, item.cached is not None) for item in items
        ]
        decisions = self.admission.decide(candidates, self._clock(), estimates)
        no_rows = features_read and self.fallback is not None and self.fallback.needs_store
        for item, decision in zip(items, decisions, strict=True):
            route = decision.route
            if no_rows and route is Route.FALLBACK and item.row is None:
                route = self.admission.without_model(item.cached is not None).route
            item.route, item.reason = route, decision.reason

    async def read_features(self, prepared: Prepared) -> None:
        """One store read (through the cache) for the events whose model needs it. When
        the store cannot answer in time, those events go down the ladder instead
        (reason `store_unavailable`): a store outage degrades, it never stops the stream."""
        with prepared.trace.stage("features"):
            await self._read_features(prepared)

    async def _read_features(self, prepared: Prepared) -> None:
        serving = prepared.serving
        needing = [item for item in prepared.admitted if self._needs_store(item.route, serving)]
        prepared.timings["features_us"] = 0
        if not needing:
            return
        started = time.perf_counter()
        for row, item in enumerate(needing):
            item.row = row
        try:
            prepared.rows = await self._lookup.fetch(
                [item.event for item in needing], self._store_timeout_s
            )
        except StoreUnavailable as exc:
            # Events whose rows were all in memory are answered as if it had been read.
            in_memory = exc.in_memory
            if in_memory is not None and any(in_memory.answered):
                prepared.rows = in_memory.rows
            answered = in_memory.answered if in_memory is not None else [False] * len(needing)
            no_fallback = self.fallback is None or self.fallback.needs_store
            for item, in_full in zip(needing, answered, strict=True):
                if in_full:
                    continue
                decision = self.admission.without_store(item.cached is not None, no_fallback)
                item.route, item.reason, item.row = decision.route, decision.reason, None
        seconds = time.perf_counter() - started
        self.metrics.stage["features"].observe(seconds)
        prepared.timings["features_us"] = int(seconds * 1e6)

    def _needs_store(self, route: Route, serving: Serving) -> bool:
        if route is Route.FULL:
            canary = serving.canary and serving.candidate.needs_store
            return serving.model.needs_store or canary
        return route is Route.FALLBACK and self.fallback.needs_store

    async def infer(self, prepared: Prepared) -> None:
        """Run the full and the fallback model on their events, one run each, at once.
        An event moved off the full path after its features were read can still take
        the fallback model: it has every input. When a run fails, the other is awaited
        before the error is raised; a retry (the runner's, on a transient ModelError)
        runs only the models whose run failed, on the same events: a run that answered
        is neither run nor counted again."""
        serving = prepared.serving
        pending = prepared.to_run
        if pending is None:  # the first attempt: routes may change from here (a rescue)
            admitted = prepared.admitted
            routes = {item.route for item in admitted}
            pending = prepared.to_run = {
                route: [item for item in admitted if item.route is route]
                for route in (Route.FULL, Route.FALLBACK)
                if route in routes
            }
        models = {Route.FULL: serving.model, Route.FALLBACK: self.fallback}
        runs = [
            self._run(prepared, route, models[route], items) for route, items in pending.items()
        ]
        with prepared.trace.stage("infer"):
            if len(runs) == 1:  # the usual batch: no tasks to run one model
                await runs[0]
                pending.clear()
            elif runs:
                outcomes = await asyncio.gather(*runs, return_exceptions=True)
                failed = None
                for route, outcome in zip(list(pending), outcomes, strict=True):
                    if outcome is None:
                        del pending[route]
                    elif failed is None:
                        failed = outcome
                if failed is not None:
                    raise failed

    async def _run(
        self, prepared: Prepared, route: Route, model: Model | None, items: list[Item]
    ) -> None:
        serving = prepared.serving
        if route is Route.FULL and serving.canary:
            items, canary = serving.split(items)
            if canary:
                await self._run_canary(prepared, model, items, canary)
                return
        if not items:
            return
        seconds = await model.run(items, prepared.rows)
        if route is Route.FULL:
            serving.meter.record(seconds, [item.answer for item in items])
        await self._answered(prepared, route, items, seconds)

    async def _run_canary(
        self, prepared: Prepared, model: Model, items: list[Item], canary: list[Item]
    ) -> None:
        """The serving version on `items` and the candidate on `canary`, at once; the
        serving version answers the canary's share too if the candidate failed. A retry
        (`infer`'s) runs only the parts not done (`Prepared.canary_runs`): none is run
        or metered twice."""
        serving, rows, done = prepared.serving, prepared.rows, prepared.canary_runs
        parts: dict[str, Any] = {}
        if items and "serving" not in done:
            parts["serving"] = model.run(items, rows)
        if "candidate" not in done:
            for item in canary:
                item.candidate = True
            parts["candidate"] = self._run_candidate(serving, canary, rows)
        outcomes = await asyncio.gather(*parts.values(), return_exceptions=True)
        failed = None
        for part, outcome in zip(parts, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                failed = failed or outcome
                continue
            done[part] = outcome
            if part == "serving":
                serving.meter.record(outcome, [item.answer for item in items])
        if failed is not None:
            raise failed
        if done["candidate"] is None and "again" not in done:
            # It failed: the serving version answers its share.
            done["again"] = await model.run(canary, rows)
            serving.meter.record(done["again"], [item.answer for item in canary])
        if done["candidate"] is not None:
            prepared.candidate_seconds = done["candidate"]
        seconds = done.get("serving", 0.0) + done.get("again", 0.0)
        await self._answered(prepared, Route.FULL, [*items, *canary], seconds)

    async def _run_candidate(
        self, serving: Serving, canary: list[Item], rows: FeatureRows | None
    ) -> float | None:
        """The canary's run on its share; None when it failed (its events then go back
        to the serving model, and the failure counts as errors for its guardrail)."""
        try:
            seconds = await serving.candidate.run(canary, rows)
        except ModelError as exc:
            for item in canary:
                item.candidate = False
            if serving.candidate_meter.failed(len(canary)):
                log.error("pipeline %s: candidate v%s failed on a batch (its events are "
                          "answered by the serving version; logged once per version): %s",
                          self.config.name, serving.candidate.signature.version, exc)  # fmt: skip
            return None
        serving.candidate_meter.record(seconds, [item.answer for item in canary])
        return seconds

    async def _answered(
        self, prepared: Prepared, route: Route, items: list[Item], seconds: float
    ) -> None:
        """Count a model's run; an answer that is NaN or infinite (an input past what the
        model's math holds) is never kept: the full model's are answered by the fallback
        model where it can, the rest go down the ladder after the models (cache, default,
        shed)."""
        if route is Route.FULL:
            self.metrics.stage["inference"].observe(seconds)
        prepared.run_seconds[route] = seconds
        unusable = [item for item in items if not finite_answer(item.answer)]
        if route is Route.FULL and unusable:
            unusable = await self._rescue(prepared, unusable)
        for item in unusable:
            decision = self.admission.without_model(item.cached is not None)
            item.route, item.reason = decision.route, decision.reason

    async def _rescue(self, prepared: Prepared, items: list[Item]) -> list[Item]:
        """The fallback model's answers for events the full model answered with NaN or
        infinity; returns those still without a usable one. Only events it has every
        input for (a fallback that reads the store needs the event's row). Its run is
        rare and not counted as the batch's fallback run: it would skew that estimate;
        its seconds are those events' inference time (`Prepared.rescue_seconds`)."""
        fallback = self.fallback
        able = [i for i in items if fallback is not None and (not fallback.needs_store
                                                               or i.row is not None)]  # fmt: skip
        if not able:
            return items
        try:
            prepared.rescue_seconds = await fallback.run(able, prepared.rows)
        except ModelError as exc:  # the ladder answers them instead
            log.warning("pipeline %s: the fallback model failed on %d events the full "
                        "model answered with NaN or infinity: %s",
                        self.config.name, len(able), exc)  # fmt: skip
            return items
        for item in able:
            item.route, item.reason = Route.FALLBACK, NON_FINITE
        rescued = {id(item) for item in able}
        return [item for item in items if id(item) not in rescued or not finite_answer(item.answer)]

    async def publish(self, prepared: Prepared) -> None:
        """Encode an outcome for every input and write them all; returns once Kafka has
        them all."""
        measure = self.metrics
        started = time.perf_counter()
        trace = prepared.trace
        if prepared.outgoing is None:  # else a retry: it sends only what was not written
            spec = self.config
            with trace.stage("encode"):
                outcomes = self._outcomes(prepared)
                trace.mark(prepared.outcome_items, outcomes)
                mark_redelivered(prepared.outcome_items, outcomes)
                prepared.outgoing = Outgoing(
                    outcomes, [item.record for item in prepared.outcome_items], spec.name,
                    spec.dead_letter_topic,
                )  # fmt: skip
        else:  # items marked since the last attempt (`PipelineRunner._mark_unsure`)
            mark_redelivered(prepared.outcome_items, prepared.outgoing.records)
        encoded = time.perf_counter()
        with trace.stage("publish"):
            await self._publisher.publish(prepared.outgoing)
        published = time.perf_counter()
        trace.end()

        measure.stage["encode"].observe(encoded - started)
        measure.stage["publish"].observe(published - encoded)
        measure.batch_size.observe(len(prepared.items))
        self._count(prepared)

    def _outcomes(self, prepared: Prepared) -> list[OutRecord]:
        timings = {
            route: {**prepared.timings, "inference_us": int(seconds * 1e6)}
            for route, seconds in prepared.run_seconds.items()
        }
        no_run = {**prepared.timings, "inference_us": 0}
        rescued = {**prepared.timings, "inference_us": int(prepared.rescue_seconds * 1e6)}
        candidate = {**prepared.timings, "inference_us": int(prepared.candidate_seconds * 1e6)}
        missing_of = prepared.rows.missing_views if prepared.rows is not None else []
        spec = self.config
        serving = prepared.serving
        out = []
        for item in prepared.outcome_items:
            if item.error is not None:
                trace_id = prepared.trace.trace_id_of(item)
                topic = spec.dead_letter_topic
                out.append(dead_letter(item.record, item.error, spec.name, topic, trace_id))
                continue
            route = item.route
            timing = timings.get(route, no_run)
            if route is Route.FALLBACK:
                model = self.fallback
                if item.reason == NON_FINITE:  # the full model's NaN, rescued (`_rescue`)
                    timing = rescued
            elif item.candidate and route is Route.FULL:
                model = serving.candidate
                timing = candidate
            else:
                model = serving.model
            answer = self._answer(item)
            read_store = item.row is not None and self._needs_store(route, serving)
            missing = list(missing_of[item.row]) if read_store else []
            if route is Route.FULL:
                for view in missing:
                    self.metrics.missing_features(view).inc()
            out.append(self._encoder.encode(item, model.signature, answer, missing, timing))
        return out

    def _answer(self, item: Item) -> dict[str, Any]:
        route = item.route
        if route is Route.FULL or route is Route.FALLBACK:
            return item.answer
        if route is Route.CACHED:
            return item.cached
        if route is Route.DEFAULT:
            return self._default_answer
        return self._shed_answer

    def _count(self, prepared: Prepared) -> None:
        """Outcome counters and end-to-end latency, once the outcomes are written."""
        measure = self.metrics
        now_s = self._clock()
        groups: dict[tuple[str, str | None, str | None], int] = {}
        latencies: dict[str, list[float]] = {}
        in_budget = 0
        use_cache = self.admission.ladder.answer_cache
        # Outcomes the publisher had to write as dead letters (too large), by index.
        rewritten = prepared.outgoing.rewritten if prepared.outgoing is not None else {}
        for index, item in enumerate(prepared.outcome_items):
            latency_s = max(0.0, now_s - item.record.timestamp_ms / 1000)
            if item.error is not None or index in rewritten:
                measure.dead_letter(rewritten.get(index) or item.error.reason)
                latencies.setdefault("DEAD_LETTER", []).append(latency_s)
                continue
            route = item.route
            key = (route.status, route.level, item.reason)
            groups[key] = groups.get(key, 0) + 1
            latencies.setdefault(route.status, []).append(latency_s)
            if route is Route.FULL:
                in_budget += now_s <= item.deadline_s
                # Only the serving model's answers: a cached answer is labelled with the
                # serving version (not a canary's; not a batch's from before a switch).
                if use_cache and not item.candidate and prepared.serving is self._cached_for:
                    self._answers.put(item.cache_key, item.answer, 0.0)
        for (status, level, reason), count in groups.items():
            measure.answered(status, level, reason, count)
        for status, seconds in latencies.items():
            metrics.observe_many(measure.end_to_end(status), seconds)
        measure.in_budget(in_budget)


def task_problems(
    config: PipelineConfig, model: Signature, fallback: Signature | None
) -> list[str]:
    """What the pipeline refuses of its models' tasks (`check` reports them too)."""
    task = model.output.task
    problems = []
    if fallback is not None and fallback.output.task != task:
        problems.append(
            f"pipeline {config.name}: the fallback model answers a {fallback.output.task} "
            f"task, the model a {task} one"
        )
    if config.degradation.default_score is not None and task == "multiclass":
        problems.append(
            f"pipeline {config.name}: degradation.default_score does not apply to a "
            "multiclass model; leave it unset (events no rung answers are shed)"
        )
    return problems


def finite_answer(answer: dict[str, Any]) -> bool:
    """Whether a model's answer is a number (score: binary, multiclass; value: regression)."""
    number = answer["value"] if "value" in answer else answer["score"]
    return math.isfinite(number)
