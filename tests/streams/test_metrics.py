"""Per-batch histogram observations equal per-event ones."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from streams.metrics import observe_many


def _samples(histogram: Histogram) -> dict:
    return {(s.name, s.labels.get("le")): s.value for s in histogram.collect()[0].samples
            if not s.name.endswith("_created")}  # fmt: skip


def test_observing_a_batch_counts_like_observing_each_value():
    amounts = [0.0, 0.001, 0.005, 0.0051, 0.25, 3.0, 100.0, 0.005]
    buckets = (0.001, 0.005, 0.25, 1.0)
    one = Histogram("h", "h", buckets=buckets, registry=CollectorRegistry())
    many = Histogram("h", "h", buckets=buckets, registry=CollectorRegistry())
    for amount in amounts:
        one.observe(amount)
    observe_many(many, amounts[:1])  # batches of one and two (light load), then the rest
    observe_many(many, amounts[1:3])
    observe_many(many, amounts[3:])
    observe_many(many, [])
    assert _samples(many) == _samples(one)
    assert _samples(many)[("h_bucket", "0.005")] == 4  # a value on a bound counts in it
