"""Shadow scoring: a candidate deployed `--shadow` answers each batch after the serving
answers are written, and its answers go to the pipeline's shadow topic (same schema and
key as the output) for offline comparison; it never delays or changes a serving answer.

The runner offers each written batch (`offer`, never blocks); a bounded queue holds
what the candidate has not scored yet and a batch that finds it full is skipped and
counted (`headrace_shadow_answers_total{result="skipped"}`): a slow candidate falls
behind, it never holds serving back. It scores the events the serving model answered
in full (their feature rows are at hand), on the candidate's own sessions, and writes
them with a producer of its own, outside the serving path's delivery and transactions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from confluent_kafka import Producer

from streams import metrics
from streams.admit import NON_FINITE, Route
from streams.encode import AnswerEncoder
from streams.pipeline import Pipeline, Prepared, finite_answer
from streams.records import Item

log = logging.getLogger(__name__)

MAX_BATCHES = 32


class ShadowScorer:
    """`offer(prepared)` from the runner; `run()` is a task the runner owns; `close()`."""

    def __init__(
        self, pipeline: Pipeline, encoder: AnswerEncoder, producer_settings: dict[str, Any]
    ) -> None:
        self._pipeline = pipeline
        self._encoder = encoder
        self._producer = Producer({**producer_settings, "linger.ms": 5})
        self._queue: asyncio.Queue[Prepared] = asyncio.Queue(MAX_BATCHES)
        name = pipeline.config.name
        self._written = metrics.SHADOW_ANSWERS.labels(name, "written")
        self._skipped = metrics.SHADOW_ANSWERS.labels(name, "skipped")
        self._failed = metrics.SHADOW_ANSWERS.labels(name, "failed")

    def offer(self, prepared: Prepared) -> None:
        """Queue a written batch for the shadow candidate, if its deployment has one."""
        if not prepared.serving.shadow:
            return
        if self._queue.full():
            self._skipped.inc(len(prepared.admitted))
            return
        prepared.serving.in_use += 1  # its models stay open until it is scored
        self._queue.put_nowait(prepared)

    async def run(self) -> None:
        while True:
            prepared = await self._queue.get()
            try:
                await self._score(prepared)
            except Exception as exc:  # the candidate's failure is its own, never serving's
                self._failed.inc(len(prepared.admitted))
                log.warning("pipeline %s: shadow candidate failed on a batch: %s",
                            self._pipeline.config.name, exc)  # fmt: skip
            finally:
                self._pipeline.done(prepared)

    async def _score(self, prepared: Prepared) -> None:
        candidate = prepared.serving.candidate
        items = [item for item in prepared.admitted if item.route is Route.FULL]
        if candidate.needs_store and not self._pipeline.model.needs_store:
            items = []  # the serving path read no features for them
        if not items:
            return
        answers, seconds = await candidate.pool.run_timed(candidate.feeds(items, prepared.rows))
        prepared.serving.candidate_meter.record(seconds, answers)
        timings = {**prepared.timings, "inference_us": int(seconds * 1e6)}
        signature = candidate.signature
        for item, answer in zip(items, answers, strict=True):
            record = self._encoder.encode(as_answered(item, answer), signature, answer, [], timings)
            self._producer.produce(record.topic, record.value, record.key,
                                   on_delivery=self._delivered)  # fmt: skip
        self._producer.poll(0)

    def _delivered(self, error, _message) -> None:
        (self._failed if error is not None else self._written).inc()

    def close(self, timeout_s: float = 5.0) -> None:
        self._producer.flush(timeout_s)


def as_answered(item: Item, answer: dict[str, Any]) -> Item:
    """The item as the candidate's answer leaves it: a NaN or infinite answer is no
    answer (`SHED`, `non_finite_answer`), never `OK` beside the serving answer's status."""
    if finite_answer(answer):
        return item
    return dataclasses.replace(item, route=Route.SHED, reason=NON_FINITE)
