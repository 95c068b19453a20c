"""Prometheus metrics of the feature stage (served by the worker's `/metrics`)."""

from prometheus_client import Counter, Gauge, Histogram

# Latency buckets for every headrace histogram: microseconds (decode) to seconds.
SECONDS_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

CACHE_HITS = Counter("headrace_feature_cache_hits", "Entity rows served from the cache.", ["view"])
CACHE_MISSES = Counter(
    "headrace_feature_cache_misses", "Entity rows read from the online store.", ["view"]
)
CACHE_EVICTIONS = Counter(
    "headrace_feature_cache_evictions", "Rows evicted by the cache's size bound.", ["view"]
)
EXPIRED = Counter(
    "headrace_feature_expired",
    "Rows older than their view's TTL, treated as missing.",
    ["view"],
)
STORE_READ_SECONDS = Histogram(
    "headrace_feature_store_read_seconds",
    "One online-store read of a batch's missing keys, per view.",
    ["view"],
    buckets=SECONDS_BUCKETS,
)
SERVED_STALENESS_SECONDS = Histogram(
    "headrace_feature_served_staleness_seconds",
    "Per batch, how long ago the stalest served feature row was read from the store.",
    ["view"],
    buckets=(0.0, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
STORE_STATE = Gauge(
    "headrace_feature_store_state",
    "The circuit breaker around the online store, per feature service: 0 closed (reading), "
    "1 open (reads refused, events degrade), 2 probing.",
    ["service"],
)
STORE_FAILURES = Counter(
    "headrace_feature_store_failures",
    "Batch reads that failed (error) or took longer than allowed (timeout), per service.",
    ["service", "kind"],
)
