"""The sample store's click-intent side: `product_stats` served for known products,
nothing for the products that click events name but the store lacks."""

from __future__ import annotations

import numpy as np
import pytest

from features.lookup import FeatureLookup
from features.sample_data import PRODUCT_FEATURES, product_id
from features.store import open_store


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def store(request, sample_assets):
    repo = (
        sample_assets.repo if request.param == "sqlite" else request.getfixturevalue("redis_repo")
    )
    return open_store(repo)


def test_click_intent_serves_a_known_product_and_nothing_for_a_missing_one(store, sample_assets):
    world = sample_assets.world
    known = world.products().iloc[5]
    missing = product_id(world.n_products)  # the first id past the known range
    response = store.get_online_features(
        features=store.get_feature_service("click_intent"),
        entity_rows=[{"product_id": known["product_id"]}, {"product_id": missing}],
        full_feature_names=True,
    ).to_dict()
    for name in PRODUCT_FEATURES:
        served, absent = response[f"product_stats__{name}"]
        assert served == pytest.approx(float(known[name]), rel=1e-6), name
        assert absent is None, name


def test_the_lookup_flags_products_missing_from_the_store(store, sample_assets):
    world = sample_assets.world
    products = world.products().set_index("product_id")
    events = world.click_events(300, np.random.default_rng(3), now_ms=0)
    lookup = FeatureLookup(store, "click_intent", {"product_id": "product_id"})
    try:
        rows = lookup.read(events.to_dict("records"))
    finally:
        lookup.close()
    known = events["product_id"].isin(products.index).to_numpy()
    assert 0 < (~known).sum() < len(events) // 10
    assert rows.missing_views == [() if k else ("product_stats",) for k in known]
    for name in PRODUCT_FEATURES:
        values = rows.columns[f"product_stats__{name}"]
        expected = products[name].reindex(events["product_id"]).to_numpy(dtype=np.float64)
        np.testing.assert_allclose(values, expected, rtol=1e-6, equal_nan=True)
