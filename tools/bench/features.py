"""`headrace bench-features`: the cost of the feature stage, per event and per batch.

Three ways to read the sample feature service for a batch of events, on SQLite and on
Redis, under two key distributions (Zipf with s = 1.1, and uniform, over 100,000
users and 10,000 merchants), at several batch sizes:

- `sdk`:   Feast's `get_online_features(...).to_dict()` for the batch's distinct keys;
- `fast`:  headrace's direct online-store read, no cache;
- `cache`: headrace's lookup with its cache warmed by the same distribution.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np

from features.config import FeatureCacheConfig
from features.lookup import FeatureLookup
from features.sample_data import SampleWorld, merchant_id, user_id
from features.store import open_store, prepare_sample_store
from infra.ports import free_port
from infra.redis import RedisServer
from tools.bench.report import machine

ENTITY_FIELDS = {"user_id": "user_id", "merchant_id": "merchant_id"}
BATCH_SIZES = (1, 32, 128, 512)
ZIPF_S = 1.1


def key_sampler(distribution: str, world: SampleWorld, seed: int) -> Callable[[int], list[dict]]:
    rng = np.random.default_rng(seed)

    def ranks(n_keys: int) -> Callable[[int], np.ndarray]:
        if distribution == "uniform":
            return lambda size: rng.integers(0, n_keys, size)
        weights = 1.0 / np.arange(1, n_keys + 1) ** ZIPF_S
        identity = rng.permutation(n_keys)  # hot keys spread over the key space
        weights /= weights.sum()
        return lambda size: identity[rng.choice(n_keys, size, p=weights)]

    users, merchants = ranks(world.n_users), ranks(world.n_merchants)

    def sample(size: int) -> list[dict]:
        return [
            {"user_id": user_id(u), "merchant_id": merchant_id(m)}
            for u, m in zip(users(size), merchants(size), strict=True)
        ]

    return sample


def measure(read: Callable[[list[dict]], object], sample, size: int, seconds: float) -> dict:
    batches = [sample(size) for _ in range(64)]
    timings = []
    deadline = time.perf_counter() + seconds
    index = 0
    while time.perf_counter() < deadline or len(timings) < 5:
        batch = batches[index % len(batches)]
        index += 1
        started = time.perf_counter()
        read(batch)
        timings.append(time.perf_counter() - started)
    p50, p99 = np.percentile(timings, [50, 99]) * 1e6
    return {"batches": len(timings), "p50_us": p50, "p99_us": p99, "per_event_us": p50 / size}


def run(state_dir: Path, seconds_per_cell: float, echo=click.echo) -> dict:
    world = SampleWorld(100_000, 10_000)
    redis = RedisServer(state_dir / "redis", free_port())
    echo("starting Redis and materializing 100,000 users and 10,000 merchants twice")
    redis.start()
    try:
        repos = {"sqlite": state_dir / "sqlite", "redis": state_dir / "redis-repo"}
        prepare_sample_store(repos["sqlite"], world)
        prepare_sample_store(repos["redis"], world, redis=redis.connection_string)
        rows = []
        for store_kind, repo in repos.items():
            store = open_store(repo)
            service = store.get_feature_service("fraud_scoring")

            def sdk(batch, store=store, service=service):
                distinct = list({(e["user_id"], e["merchant_id"]): e for e in batch}.values())
                return store.get_online_features(
                    features=service, entity_rows=distinct, full_feature_names=True
                ).to_dict()

            fast = FeatureLookup(
                store,
                "fraud_scoring",
                ENTITY_FIELDS,
                FeatureCacheConfig(max_entries=0, max_staleness_s=0),
            )
            for distribution in ("zipf", "uniform"):
                sample = key_sampler(distribution, world, seed=3)
                cached = FeatureLookup(
                    store,
                    "fraud_scoring",
                    ENTITY_FIELDS,
                    FeatureCacheConfig(max_entries=200_000, max_staleness_s=3600),
                )
                for _ in range(200):  # warm the cache with the same distribution
                    cached.read(sample(512))
                for method, read in (("sdk", sdk), ("fast", fast.read), ("cache", cached.read)):
                    for size in BATCH_SIZES:
                        cell = measure(read, sample, size, seconds_per_cell)
                        row = {"store": store_kind, "distribution": distribution,
                               "method": method, "batch_size": size, **cell}  # fmt: skip
                        rows.append(row)
                        echo(
                            f"  {store_kind:>6} {distribution:>7} {method:>5} batch {size:>3}: "
                            f"{cell['per_event_us']:8.1f} µs/event, p99 {cell['p99_us']:9.0f} "
                            "µs/batch"
                        )
                cached.close()
            fast.close()
        return {"machine": machine(), "rows": rows}
    finally:
        redis.stop()


def write_report(results: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "features.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# Feature stage benchmark",
        "",
        "Per-event cost is the batch's p50 divided by its size. Keys: 100,000 users and "
        f"10,000 merchants, Zipf (s = {ZIPF_S}) or uniform; `cache` was warmed by the "
        "same distribution.",
        "",
        "| store | keys | method | batch | µs/event | p50 µs/batch | p99 µs/batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['store']} | {r['distribution']} | {r['method']} | {r['batch_size']} | "
            f"{r['per_event_us']:.1f} | {r['p50_us']:.0f} | {r['p99_us']:.0f} |"
        )
    path = out_dir / "features.md"
    path.write_text("\n".join(lines) + "\n")
    return path
