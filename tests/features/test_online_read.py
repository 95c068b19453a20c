"""The direct store read and the cached lookup against Feast's own `get_online_features`."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pytest
from feast.infra.key_encoding_utils import serialize_entity_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.type_map import python_values_to_proto_values
from feast.value_type import ValueType

from features.config import FeatureCacheConfig
from features.errors import FeatureStoreError
from features.lookup import FeatureLookup
from features.online_read import OnlineViewReader, _direct_key_codec
from features.store import open_store, prepare_sample_store
from infra.ports import free_port
from infra.redis import RedisServer

ENTITY_FIELDS = {"user_id": "user_id", "merchant_id": "merchant_id"}
USER_FEATURES = ["txn_count_7d", "avg_amount_7d", "chargeback_rate_90d", "account_age_days"]
# Written with an old feature timestamp: Feast still serves it, its TTL says it expired.
EXPIRED_USER = "u-expired"


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def store(request, sample_assets):
    repo = (
        sample_assets.repo if request.param == "sqlite" else request.getfixturevalue("redis_repo")
    )
    store = open_store(repo)
    old = datetime.now(UTC) - timedelta(days=30)
    store.write_to_online_store(
        "user_stats",
        pd.DataFrame(
            {
                "user_id": [EXPIRED_USER],
                "txn_count_7d": [3],
                "avg_amount_7d": [12.5],
                "chargeback_rate_90d": [0.25],
                "account_age_days": [40],
                "event_timestamp": [old],
            }
        ),
    )
    return store


def sdk_values(store, users: list[str]) -> np.ndarray:
    response = store.get_online_features(
        features=[f"user_stats:{name}" for name in USER_FEATURES],
        entity_rows=[{"user_id": user} for user in users],
    ).to_dict()
    return np.array(
        [[np.nan if v is None else v for v in response[name]] for name in USER_FEATURES],
        dtype=np.float64,
    ).T


def test_direct_read_equals_get_online_features(store):
    users = ["u0000001", "u0000002", "nobody", EXPIRED_USER, "u0000001"]
    reader = OnlineViewReader(store, "user_stats", USER_FEATURES)
    rows = reader.read([(user,) for user in users])
    np.testing.assert_allclose(rows.values, sdk_values(store, users), rtol=1e-6, equal_nan=True)
    assert np.isnan(rows.event_ts_s[2])  # absent entity: no timestamp either
    assert rows.event_ts_s[3] < rows.event_ts_s[0]


def test_lookup_treats_rows_past_their_ttl_as_missing(store):
    lookup = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS)
    try:
        rows = lookup.read(
            [
                {"user_id": EXPIRED_USER, "merchant_id": "m000001"},
                {"user_id": "u0000001", "merchant_id": "m000001"},
            ]
        )
    finally:
        lookup.close()
    assert rows.missing_views == [("user_stats",), ()]
    assert np.isnan(rows.columns["user_stats__avg_amount_7d"][0])
    # Feast itself would have served the stale value.
    assert sdk_values(store, [EXPIRED_USER])[0, 1] == pytest.approx(12.5)


def test_lookup_equals_get_online_features_for_live_rows_and_caches_them(store):
    lookup = FeatureLookup(
        store,
        "fraud_scoring",
        ENTITY_FIELDS,
        FeatureCacheConfig(max_entries=1000, max_staleness_s=60),
    )
    events = [{"user_id": f"u{i:07d}", "merchant_id": f"m{i % 7:06d}"} for i in range(40)]
    events.append({"user_id": "nobody", "merchant_id": "nowhere"})
    try:
        first = lookup.read(events)
        second = lookup.read(events)
    finally:
        lookup.close()
    response = store.get_online_features(
        features=store.get_feature_service("fraud_scoring"),
        entity_rows=events,
        full_feature_names=True,
    ).to_dict()
    for ref in lookup.feature_refs:
        expected = np.array([np.nan if v is None else v for v in response[ref]], dtype=float)
        np.testing.assert_allclose(first.columns[ref], expected, rtol=1e-6, equal_nan=True)
        np.testing.assert_array_equal(second.columns[ref], first.columns[ref])
    assert first.store_reads == first.unique_keys == 40 + 7 + 2
    assert second.store_reads == 0
    assert second.missing_views[-1] == ("user_stats", "merchant_stats")


def test_every_row_expires_once_the_clock_passes_the_ttl(store):
    now = datetime.now(UTC).timestamp()
    lookup = FeatureLookup(
        store, "fraud_scoring", ENTITY_FIELDS, clock=lambda: now + timedelta(days=3).total_seconds()
    )
    try:
        rows = lookup.read([{"user_id": "u0000001", "merchant_id": "m000001"}])
    finally:
        lookup.close()
    assert rows.missing_views == [("user_stats", "merchant_stats")]


def test_the_sqlite_store_read_with_sql_equals_the_providers_read(sample_assets):
    store = open_store(sample_assets.repo)
    reader = OnlineViewReader(store, "user_stats", USER_FEATURES)
    assert reader._sqlite is not None  # the SQLite store takes the SQL path
    keys = [(user,) for user in ["u0000003", "nobody", "u0000004", "u0000003", EXPIRED_USER]]
    by_sql = reader.read(keys)
    reader._sqlite = None
    by_provider = reader.read(keys)
    np.testing.assert_array_equal(by_sql.values, by_provider.values)
    np.testing.assert_array_equal(by_sql.event_ts_s, by_provider.event_ts_s)
    assert reader.read([]).values.shape == (0, len(USER_FEATURES))


@pytest.mark.parametrize(
    ("value_type", "values"),
    [(ValueType.STRING, ["u0000001", "ü-ß", ""]), (ValueType.INT64, [0, -1, 2**40])],
)
def test_keys_are_serialized_as_feast_serializes_them_and_read_back(value_type, values):
    def entity_keys(keys):
        values = python_values_to_proto_values([key[0] for key in keys], value_type)
        return [EntityKeyProto(join_keys=["k"], entity_values=[value]) for value in values]

    codec = _direct_key_codec(["k"], [value_type], 3, entity_keys)
    assert codec is not None
    blob_of, key_of = codec
    for value, proto in zip(values, entity_keys([(v,) for v in values]), strict=True):
        feasts = serialize_entity_key(proto, entity_key_serialization_version=3)
        assert blob_of(value) == feasts
        assert key_of(feasts) == (value,)
    other = EntityKeyProto(join_keys=["other"], entity_values=entity_keys([(values[0],)])[0]
                           .entity_values)  # fmt: skip
    assert key_of(serialize_entity_key(other, entity_key_serialization_version=3)) is None
    if value_type is ValueType.STRING:  # bytes that are no text: not a key it knows
        assert key_of(blob_of("ab")[:-1] + b"\xff") is None
    assert _direct_key_codec(["a", "b"], [value_type] * 2, 3, entity_keys) is None


def test_a_key_of_another_python_type_is_serialized_by_feast(sample_assets):
    reader = OnlineViewReader(open_store(sample_assets.repo), "user_stats", USER_FEATURES)
    assert reader._blob_of is not None  # string keys take the direct path
    (direct,) = reader._serialized([("u0000001",)]).values()
    (by_feast,) = reader._serialized([(np.str_("u0000001"),)]).values()
    assert by_feast == direct


def test_a_stopped_redis_fails_a_read_at_once_and_a_restarted_one_answers_the_next(
    sample_assets, tmp_path
):
    """redis-py's own retries (three, backing off from 1 s) held a read of a stopped
    Redis for about 10 s; the store breaker is the retry policy, so a read fails at once.
    A restarted Redis (empty here) answers the next read on a fresh connection."""
    server = RedisServer(tmp_path / "redis", free_port())
    server.start()
    try:
        repo = tmp_path / "repo"
        prepare_sample_store(repo, sample_assets.world, redis=server.connection_string)
        reader = OnlineViewReader(open_store(repo), "user_stats", USER_FEATURES)
        user = "u0000001"
        assert not np.isnan(reader.read([(user,)]).values).any()
        server.stop()
        started = time.monotonic()
        with pytest.raises(FeatureStoreError, match="user_stats"):
            reader.read([(user,)])
        assert time.monotonic() - started < 3.0
        server.start()
        assert np.isnan(reader.read([(user,)]).values).all()  # empty: no persistence
    finally:
        server.stop()
