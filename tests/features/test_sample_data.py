"""The click side of the synthetic world: events that fit their schema, unknown products
among them, the same world for the same seed, and a ground truth a model can learn."""

from __future__ import annotations

import fastavro
import numpy as np
import pandas as pd

from features.sample_data import (
    INTENT_CLASSES,
    PAGE_TYPES,
    PRODUCT_FEATURES,
    SampleWorld,
    click_intent_probabilities,
)
from schemas.catalogue import load_schema

WORLD = SampleWorld()


def test_click_events_are_valid_records_of_the_click_schema():
    schema = load_schema("click.avsc")
    events = WORLD.click_events(500, np.random.default_rng(0), now_ms=1_700_000_000_000)
    assert list(events.columns) == [field["name"] for field in schema["fields"]]
    parsed = fastavro.parse_schema(schema)
    for record in events.to_dict("records"):
        record = {k: v.item() if isinstance(v, np.generic) else v for k, v in record.items()}
        assert fastavro.validation.validate(record, parsed, raise_errors=True)
    assert set(events["page_type"]) == set(PAGE_TYPES)
    assert (events["dwell_ms"] >= 0).all() and (events["dwell_ms"] == 0).any()
    assert events["event_id"].is_unique


def test_some_clicked_products_have_no_statistics():
    known = set(WORLD.products()["product_id"])
    events = WORLD.click_events(2_000, np.random.default_rng(1), now_ms=0)
    unknown = ~events["product_id"].isin(known)
    assert 0.005 < unknown.mean() < 0.05


def test_the_same_seed_gives_the_same_world():
    again = SampleWorld()
    pd.testing.assert_frame_equal(again.products(), WORLD.products())
    first = WORLD.click_events(50, np.random.default_rng(2), now_ms=0)
    second = again.click_events(50, np.random.default_rng(2), now_ms=0)
    pd.testing.assert_frame_equal(first, second)


def test_intent_probabilities_depend_on_the_page_the_dwell_and_the_product():
    stats = WORLD.products().iloc[:1][list(PRODUCT_FEATURES)].add_prefix("product_stats__")
    rows = pd.concat([stats] * 3, ignore_index=True)
    rows["page_type"] = ["home", "checkout", "product"]
    rows["dwell_ms"] = [0, 60_000, 60_000]
    p = click_intent_probabilities(rows)
    assert p.shape == (3, len(INTENT_CLASSES))
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    classes = {name: i for i, name in enumerate(INTENT_CLASSES)}
    assert p[0].argmax() == classes["leave"]  # left the home page at once
    assert p[1, classes["purchase"]] > p[2, classes["purchase"]]
    cheaper = rows.iloc[[2]].assign(product_stats__price=rows["product_stats__price"][2] / 4)
    assert (
        click_intent_probabilities(cheaper)[0, classes["add_to_cart"]]
        > p[2, classes["add_to_cart"]]
    )
