"""Feast objects of the sample fraud pipeline: entities, views and the feature service.

A feature engineer adds a view here, adds it to a feature service, and names the
service in a pipeline's config; `headrace features prepare` (or `feast apply` in this
folder) registers it. Sources are parquet files under `data/`, relative to this repo.
"""

from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Float32, Int64

user = Entity(
    name="user", join_keys=["user_id"], value_type=ValueType.STRING, description="A card holder."
)
merchant = Entity(
    name="merchant",
    join_keys=["merchant_id"],
    value_type=ValueType.STRING,
    description="A merchant.",
)

user_stats = FeatureView(
    name="user_stats",
    entities=[user],
    ttl=timedelta(days=2),
    schema=[
        Field(name="txn_count_7d", dtype=Int64),
        Field(name="avg_amount_7d", dtype=Float32),
        Field(name="chargeback_rate_90d", dtype=Float32),
        Field(name="account_age_days", dtype=Int64),
    ],
    source=FileSource(path="data/user_stats.parquet", timestamp_field="event_timestamp"),
    description="Precomputed spending statistics of a card holder.",
)

merchant_stats = FeatureView(
    name="merchant_stats",
    entities=[merchant],
    ttl=timedelta(days=2),
    schema=[
        Field(name="risk_score", dtype=Float32),
        Field(name="txn_count_7d", dtype=Int64),
        Field(name="avg_amount_7d", dtype=Float32),
    ],
    source=FileSource(path="data/merchant_stats.parquet", timestamp_field="event_timestamp"),
    description="Precomputed statistics and risk of a merchant.",
)

fraud_scoring = FeatureService(
    name="fraud_scoring",
    features=[user_stats, merchant_stats],
    description="Everything the sample fraud model reads from Feast.",
)

ALL = [user, merchant, user_stats, merchant_stats, fraud_scoring]
