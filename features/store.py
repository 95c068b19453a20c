"""Opening the Feast store and filling it with the sample world's features (both sample
pipelines': fraud scoring and click intent)."""

from __future__ import annotations

import logging
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import yaml

from features.errors import FeatureStoreError, StoreUnreachable
from features.sample_data import SampleWorld

log = logging.getLogger(__name__)

PACKAGED_REPO = Path(__file__).parent / "repo"


def open_store(repo_path: Path):
    """A FeatureStore over the repo folder holding `feature_store.yaml`."""
    from feast import FeatureStore

    if not (repo_path / "feature_store.yaml").is_file():
        raise FeatureStoreError(
            f"expected a Feast repo with feature_store.yaml in {repo_path}; "
            "hint: run `headrace features prepare` first"
        )
    return FeatureStore(repo_path=str(repo_path))


def write_repo_config(repo_path: Path, redis: str | None = None) -> None:
    """feature_store.yaml in `repo_path`: the packaged one, or with a Redis online store
    at `redis` (host:port) in place of SQLite."""
    repo_path.mkdir(parents=True, exist_ok=True)
    target = repo_path / "feature_store.yaml"
    if redis is None:
        if target.resolve() != (PACKAGED_REPO / "feature_store.yaml").resolve():
            shutil.copy(PACKAGED_REPO / "feature_store.yaml", target)
        return
    config = yaml.safe_load((PACKAGED_REPO / "feature_store.yaml").read_text())
    config["online_store"] = {"type": "redis", "connection_string": redis}
    target.write_text(yaml.safe_dump(config, sort_keys=False))


def prepare_sample_store(repo_path: Path, world: SampleWorld, redis: str | None = None) -> None:
    """Write the sample world's statistics, register the definitions, materialize online.

    Blocks for a few seconds (parquet, SQLite or Redis writes). Safe to run again: it
    overwrites the sample rows with fresh timestamps. With `redis` (host:port) the
    online store is Redis instead of SQLite.
    """
    from features.repo import definitions

    if redis is not None:
        _check_reachable(redis)  # before the repo's config names it
    if redis is not None or not (repo_path / "feature_store.yaml").exists():
        write_repo_config(repo_path, redis)
    data = repo_path / "data"
    data.mkdir(exist_ok=True)

    now = datetime.now(UTC).replace(microsecond=0)
    # The fraud tables share one stream and the click table has its own, so adding
    # a table leaves the others' timestamps as they were for a seed.
    fraud_rng = np.random.default_rng(world.seed + 2)
    tables = (
        ("user_stats", world.users(), fraud_rng),
        ("merchant_stats", world.merchants(), fraud_rng),
        ("product_stats", world.products(), np.random.default_rng(world.seed + 4)),
    )
    for name, frame, rng in tables:
        # Fresh rows: within the last hour, well inside the views' TTL.
        frame["event_timestamp"] = now - timedelta(seconds=1) * rng.integers(0, 3600, len(frame))
        frame.to_parquet(data / f"{name}.parquet", index=False)

    store = open_store(repo_path)
    store.apply(definitions.ALL)
    store.materialize(start_date=now - timedelta(days=1), end_date=now + timedelta(seconds=1))
    log.info(
        "materialized %d users, %d merchants and %d products into %s",
        world.n_users,
        world.n_merchants,
        world.n_products,
        repo_path,
    )


def _check_reachable(redis: str) -> None:
    """StoreUnreachable unless Redis at `redis` (host:port) answers a ping within 2 s."""
    import redis as redis_client

    host, _, port = redis.rpartition(":")
    try:
        redis_client.Redis(
            host=host or "127.0.0.1", port=int(port), socket_connect_timeout=2, socket_timeout=2
        ).ping()
    except (ValueError, redis_client.RedisError) as exc:
        raise StoreUnreachable(
            f"Redis at {redis} does not answer ({exc}); hint: start it (`headrace redis "
            "start` for a local one) or check the address; the repo still uses its store"
        ) from exc
