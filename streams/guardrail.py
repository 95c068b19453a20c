"""Guardrails: a rule given with a candidate's deploy, checked against the serving
version's answers over a sliding window, that rolls the candidate back when broken.

Each version's answers are metered per batch (`VersionMeter.record`: one histogram
observation, three counter increments and one deque append, bound once per version),
and the control thread (`streams/swap.py: ModelSwitcher.guard`) asks `breach` about
the samples of the last `window_s` seconds since the candidate started answering. The
rule decides only once each side has `min_answers` answers in the window; then any
limit set breaks it:

- latency: the candidate's p99 run time, weighted by events (each event of a batch
  waited the batch's run), above the serving version's by more than
  `max_p99_increase_ms`;
- errors: the share of the candidate's answers that were not numbers (the answer was
  taken from the ladder instead), or that it failed to give at all (its run raised: the
  serving version answered those events), above `max_error_rate`;
- score drift: the candidate's mean score (value, for regression) differs from the
  serving version's by more than `max_score_drift`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from streams import metrics
from streams.errors import ConfigError

# Batches kept per version: enough for a window at a few hundred batches a second.
_SAMPLES = 16_384


@dataclass(frozen=True)
class Guardrail:
    """A candidate's rule: limits relative to the serving version (None: not checked)."""

    window_s: float = 30.0
    max_p99_increase_ms: float | None = None
    max_error_rate: float | None = None
    max_score_drift: float | None = None
    min_answers: int = 20
    """Answers each side needs in the window before the rule decides."""

    def __post_init__(self) -> None:
        limits = (self.max_p99_increase_ms, self.max_error_rate, self.max_score_drift)
        if all(limit is None for limit in limits):
            raise ConfigError(
                "a guardrail needs at least one limit: --max-p99-increase-ms, "
                "--max-error-rate or --max-score-drift"
            )
        checks = {
            "window_s": self.window_s > 0,
            "min_answers": self.min_answers >= 1,
            "max_p99_increase_ms": (self.max_p99_increase_ms or 0) >= 0,
            "max_error_rate": 0 <= (self.max_error_rate or 0) <= 1,
            "max_score_drift": (self.max_score_drift or 0) >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"guardrail {name}: got {getattr(self, name)}; expected a positive "
                    "window and answer count, limits >= 0, an error rate within [0, 1]"
                )

    def as_dict(self) -> dict:
        return asdict(self)


class Sample(NamedTuple):
    """One batch of a version's answers."""

    at_s: float
    """Monotonic time it was recorded."""
    run_s: float
    answers: int
    errors: int
    score_sum: float


class Breach(NamedTuple):
    reason: str
    """`latency`, `errors` or `score_drift` (the counter's label)."""
    detail: str


class VersionMeter:
    """One version's answers in one pipeline: its metrics' children (bound once) and the
    recent samples its guardrail reads (a bounded deque: appended on the event loop,
    read on the control thread; a deque's append and copy are atomic, no lock)."""

    __slots__ = ("_errors", "_labels", "_ok", "_run", "_score_sum", "clock", "failures",
                 "samples")  # fmt: skip

    def __init__(
        self, pipeline: str, version: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._labels = (pipeline, version)
        self.clock = clock
        self.samples: deque[Sample] = deque(maxlen=_SAMPLES)
        self.failures = 0
        self._run = metrics.MODEL_RUN_SECONDS.labels(pipeline, version)
        self._ok = metrics.MODEL_ANSWERS.labels(pipeline, version, "ok")
        self._errors = metrics.MODEL_ANSWERS.labels(pipeline, version, "error")
        self._score_sum = metrics.MODEL_SCORE_SUM.labels(pipeline, version)

    def retire(self) -> None:
        """Stop exporting the version's series: it left the pipeline. What it records
        after counts nowhere; its samples go (a guardrail judges a version that returns
        from its return, with a meter of its own)."""
        pipeline, version = self._labels
        self.samples.clear()
        self.failures = 0
        metrics.remove(metrics.MODEL_RUN_SECONDS, pipeline, version)
        metrics.remove(metrics.MODEL_ANSWERS, pipeline, version, "ok")
        metrics.remove(metrics.MODEL_ANSWERS, pipeline, version, "error")
        metrics.remove(metrics.MODEL_SCORE_SUM, pipeline, version)

    def record(self, run_s: float, answers: Sequence[dict[str, Any]]) -> None:
        """A run of `run_s` answered `answers` (each with a score, or a value)."""
        errors, score_sum = 0, 0.0
        for answer in answers:
            number = answer["value"] if "value" in answer else answer["score"]
            if math.isfinite(number):
                score_sum += number
            else:
                errors += 1
        self._run.observe(run_s)
        self._ok.inc(len(answers) - errors)
        if errors:
            self._errors.inc(errors)
        self._score_sum.inc(score_sum)
        self.samples.append(Sample(self.clock(), run_s, len(answers), errors, score_sum))

    def failed(self, count: int) -> bool:
        """A run of `count` answers failed (the version answered none of them): all
        errors to its guardrail. True the first time, for one log line per version."""
        self._errors.inc(count)
        self.samples.append(Sample(self.clock(), 0.0, count, count, 0.0))
        self.failures += 1
        return self.failures == 1

    def since(self, start_s: float) -> list[Sample]:
        return [sample for sample in list(self.samples) if sample.at_s >= start_s]


def breach(
    rule: Guardrail, serving: Sequence[Sample], candidate: Sequence[Sample]
) -> Breach | None:
    """The first limit of `rule` the candidate's samples break against the serving
    version's; None while it holds, or while either side has too few answers."""
    served, tried = _count(serving), _count(candidate)
    if served < rule.min_answers or tried < rule.min_answers:
        return None
    if rule.max_p99_increase_ms is not None:
        base_ms, cand_ms = p99_ms(serving), p99_ms(candidate)
        if cand_ms - base_ms > rule.max_p99_increase_ms:
            return Breach("latency", f"p99 {cand_ms:.1f} ms against the serving version's "
                          f"{base_ms:.1f} ms (limit +{rule.max_p99_increase_ms:g} ms)")  # fmt: skip
    if rule.max_error_rate is not None:
        rate = sum(s.errors for s in candidate) / tried
        if rate > rule.max_error_rate:
            return Breach("errors", f"error rate {rate:.3f} over {tried} answers "
                          f"(limit {rule.max_error_rate:g})")  # fmt: skip
    if rule.max_score_drift is not None:
        base, cand = _mean_score(serving), _mean_score(candidate)
        if base is not None and cand is not None and abs(cand - base) > rule.max_score_drift:
            return Breach("score_drift", f"mean score {cand:.4f} against the serving "
                          f"version's {base:.4f} (limit ±{rule.max_score_drift:g})")  # fmt: skip
    return None


def p99_ms(samples: Sequence[Sample]) -> float:
    """The 99th percentile of run time over events (a batch's run counts once per event)."""
    ordered = sorted((s.run_s, s.answers) for s in samples if s.answers)
    wanted = 0.99 * sum(answers for _, answers in ordered)
    seen = 0
    for run_s, answers in ordered:
        seen += answers
        if seen >= wanted:
            return run_s * 1000
    return 0.0


def _count(samples: Sequence[Sample]) -> int:
    return sum(s.answers for s in samples)


def _mean_score(samples: Sequence[Sample]) -> float | None:
    scored = sum(s.answers - s.errors for s in samples)
    return sum(s.score_sum for s in samples) / scored if scored else None
