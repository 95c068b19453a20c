"""Feast objects of the sample pipelines: entities, views and one feature service per
pipeline (`fraud_scoring` for the fraud pipeline, `click_intent` for the click one).

A feature engineer adds a view here, adds it to a feature service, and names the
service in a pipeline's config; `headrace features prepare` (or `feast apply` in this
folder) registers it. Sources are parquet files under `data/`, relative to this repo.
"""

from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Float32, Float64, Int64

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

product = Entity(
    name="product",
    join_keys=["product_id"],
    value_type=ValueType.STRING,
    description="A product of the web shop.",
)

product_stats = FeatureView(
    name="product_stats",
    entities=[product],
    # Catalogue statistics move slowly: a week-old row is still worth serving.
    ttl=timedelta(days=7),
    schema=[
        Field(name="price", dtype=Float64),
        Field(name="popularity_7d", dtype=Float32),
        Field(name="conversion_rate_30d", dtype=Float32),
        Field(name="return_rate_90d", dtype=Float32),
    ],
    source=FileSource(path="data/product_stats.parquet", timestamp_field="event_timestamp"),
    description="Price and shopper behaviour around a product.",
)

click_intent = FeatureService(
    name="click_intent",
    features=[product_stats],
    description="Everything the sample click-intent model reads from Feast.",
)

ALL = [
    user,
    merchant,
    user_stats,
    merchant_stats,
    fraud_scoring,
    product,
    product_stats,
    click_intent,
]
