"""A deterministic synthetic world for the sample pipelines: users, merchants and
payments for fraud scoring; products and page views (clicks) for click intent.

The same seed gives the same entity statistics in every process, so the features
materialized into Feast, the events `headrace produce` sends and the data the sample
models are trained on all describe one world, and the models' scores mean something.
Each entity table draws from its own random stream (seed + a fixed offset), so adding a
table never changes the ones before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

# Share of sampled events whose user, merchant or product has no row in Feast, so the
# missing-entity path is exercised by every demo and test.
UNKNOWN_ENTITY_RATE = 0.02

# The click pipeline's categorical input and its four outcomes (in this order in
# `click_intent_probabilities`).
PAGE_TYPES = ("home", "search", "product", "cart", "checkout")
INTENT_CLASSES = ("browse", "add_to_cart", "purchase", "leave")
PRODUCT_FEATURES = ("price", "popularity_7d", "conversion_rate_30d", "return_rate_90d")
# How often each page type is viewed, and its typical (median) dwell time.
_PAGE_SHARES = np.array([0.20, 0.25, 0.35, 0.12, 0.08])
_TYPICAL_DWELL_MS = np.array([4_000.0, 9_000.0, 25_000.0, 15_000.0, 40_000.0])
# Share of page views left at once (dwell 0).
_BOUNCE_RATE = 0.04
# Ground truth of the click pipeline: per-class logit of each page type (rows:
# INTENT_CLASSES, columns: PAGE_TYPES) ...
_PAGE_LOGITS = np.array(
    [
        [1.0, 1.2, 0.8, -0.5, -1.5],  # browse
        [-2.5, -1.0, 0.0, 0.2, -1.5],  # add_to_cart
        [-4.5, -3.5, -2.0, 0.0, 1.5],  # purchase
        [1.2, 0.5, 0.0, -0.3, -0.5],  # leave
    ]
)
# ... and its weights on the numbers, each centred on a typical value: log1p(dwell
# in s), log(price), popularity, conversion rate, return rate, left at once.
_NUMBER_CENTRES = np.array([3.0, 3.3, 1.0, 0.04, 0.09, 0.0])
_NUMBER_WEIGHTS = np.array(
    [
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # browse
        [0.8, -0.6, 0.4, 30.0, 0.0, -3.0],  # add_to_cart
        [0.9, -0.4, 0.0, 60.0, -8.0, -4.0],  # purchase
        [-1.2, 0.4, -0.4, -10.0, 0.0, 3.0],  # leave
    ]
)


@dataclass(frozen=True)
class SampleWorld:
    n_users: int = 10_000
    n_merchants: int = 1_000
    seed: int = 7
    n_products: int = 2_000

    def users(self) -> pd.DataFrame:
        return self._users.copy()

    def merchants(self) -> pd.DataFrame:
        return self._merchants.copy()

    def products(self) -> pd.DataFrame:
        """product_id and the `product_stats` features (price float64, the rest float32)."""
        return self._products.copy()

    @cached_property
    def _users(self) -> pd.DataFrame:
        rng = np.random.default_rng(self.seed)
        n = self.n_users
        return pd.DataFrame(
            {
                "user_id": [user_id(i) for i in range(n)],
                "txn_count_7d": rng.poisson(rng.gamma(2.0, 4.0, n)).astype(np.int64),
                "avg_amount_7d": rng.lognormal(3.5, 0.8, n).astype(np.float32),
                "chargeback_rate_90d": rng.beta(0.6, 40.0, n).astype(np.float32),
                "account_age_days": rng.integers(1, 3650, n).astype(np.int64),
            }
        )

    @cached_property
    def _merchants(self) -> pd.DataFrame:
        rng = np.random.default_rng(self.seed + 1)
        n = self.n_merchants
        return pd.DataFrame(
            {
                "merchant_id": [merchant_id(i) for i in range(n)],
                "risk_score": rng.beta(1.5, 10.0, n).astype(np.float32),
                "txn_count_7d": rng.poisson(rng.gamma(3.0, 50.0, n)).astype(np.int64),
                "avg_amount_7d": rng.lognormal(4.0, 0.7, n).astype(np.float32),
            }
        )

    def events(self, n: int, rng: np.random.Generator, now_ms: int | None = None) -> pd.DataFrame:
        """n payments by known (and a few unknown) users at known (and unknown) merchants."""
        users = rng.integers(0, self.n_users, n)
        merchants = rng.integers(0, self.n_merchants, n)
        # Unknown ids lie just past the known range: well-formed, absent from Feast.
        users = np.where(rng.random(n) < UNKNOWN_ENTITY_RATE, users + self.n_users, users)
        merchants = np.where(
            rng.random(n) < UNKNOWN_ENTITY_RATE, merchants + self.n_merchants, merchants
        )
        spend_scale = self._users["avg_amount_7d"].to_numpy()[users % self.n_users]
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return pd.DataFrame(
            {
                "user_id": [user_id(i) for i in users],
                "merchant_id": [merchant_id(i) for i in merchants],
                # Mostly near the user's usual spend, sometimes far above it.
                "amount": np.round(
                    spend_scale * rng.lognormal(0.0, 0.6, n) * np.where(rng.random(n) < 0.05, 8, 1),
                    2,
                ),
                "hour_of_day": rng.integers(0, 24, n).astype(np.int32),
                "is_online": rng.random(n) < 0.4,
                "event_time_ms": np.full(n, now_ms, dtype=np.int64),
            }
        )

    @cached_property
    def _products(self) -> pd.DataFrame:
        # seed + 2 draws the fraud tables' timestamps in `prepare_sample_store`.
        rng = np.random.default_rng(self.seed + 3)
        n = self.n_products
        return pd.DataFrame(
            {
                "product_id": [product_id(i) for i in range(n)],
                "price": np.round(rng.lognormal(3.3, 0.9, n), 2),
                # Views in the last 7 days relative to the shop's average product.
                "popularity_7d": rng.gamma(0.8, 1.25, n).astype(np.float32),
                "conversion_rate_30d": rng.beta(2.0, 50.0, n).astype(np.float32),
                "return_rate_90d": rng.beta(1.5, 15.0, n).astype(np.float32),
            }
        )

    def click_events(
        self, n: int, rng: np.random.Generator, now_ms: int | None = None
    ) -> pd.DataFrame:
        """n page views of known (and a few unknown) products; the columns are the fields
        of `schemas/click.avsc`. Popular products are viewed more often."""
        popularity = self._products["popularity_7d"].to_numpy(dtype=np.float64) + 0.05
        products = rng.choice(self.n_products, n, p=popularity / popularity.sum())
        # Unknown ids lie just past the known range: well-formed, absent from Feast.
        products = np.where(
            rng.random(n) < UNKNOWN_ENTITY_RATE, products + self.n_products, products
        )
        pages = rng.choice(len(PAGE_TYPES), n, p=_PAGE_SHARES)
        dwell_ms = np.rint(_TYPICAL_DWELL_MS[pages] * rng.lognormal(0.0, 0.9, n))
        dwell_ms = np.where(rng.random(n) < _BOUNCE_RATE, 0, dwell_ms).astype(np.int64)
        sessions = rng.integers(0, max(1, n // 8), n)
        event_ids = rng.integers(0, 2**63 - 1, n, dtype=np.int64)
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return pd.DataFrame(
            {
                "event_id": [f"c{i:016x}" for i in event_ids],
                "session_id": [f"s{i:08d}" for i in sessions],
                "product_id": [product_id(i) for i in products],
                "page_type": np.array(PAGE_TYPES, dtype=object)[pages],
                "dwell_ms": dwell_ms,
                "event_time_ms": np.full(n, now_ms, dtype=np.int64),
            }
        )


def click_intent_probabilities(features: pd.DataFrame) -> np.ndarray:
    """The ground truth the click-intent model learns: (rows, 4) probabilities over
    INTENT_CLASSES, a softmax of page-type and product effects.

    `features` holds `page_type`, `dwell_ms` and the `product_stats__<feature>` columns,
    with no missing values (fill absent products first). Longer dwell means engagement
    (add to cart, purchase) and leaving at once means leaving; cart and checkout pages
    lead to purchases; converting, popular, cheap products are bought, often-returned ones
    less so.
    """
    pages = features["page_type"].map({page: i for i, page in enumerate(PAGE_TYPES)})
    if pages.isna().any():
        unknown = sorted(set(features["page_type"][pages.isna()]))
        raise ValueError(f"expected page types among {PAGE_TYPES}, got {unknown}")
    dwell_ms = features["dwell_ms"].to_numpy(dtype=np.float64)
    numbers = np.column_stack(
        [
            np.log1p(dwell_ms / 1000.0),
            np.log(features["product_stats__price"].to_numpy(dtype=np.float64)) - 3.3,
            features["product_stats__popularity_7d"].to_numpy(dtype=np.float64),
            features["product_stats__conversion_rate_30d"].to_numpy(dtype=np.float64),
            features["product_stats__return_rate_90d"].to_numpy(dtype=np.float64),
            (dwell_ms == 0).astype(np.float64),
        ]
    )
    logits = (
        _PAGE_LOGITS[:, pages.to_numpy(dtype=np.int64)].T
        + (numbers - _NUMBER_CENTRES) @ _NUMBER_WEIGHTS.T
    )
    logits -= logits.max(axis=1, keepdims=True)
    weights = np.exp(logits)
    return weights / weights.sum(axis=1, keepdims=True)


def fraud_probability(features: pd.DataFrame) -> np.ndarray:
    """The ground truth the sample model learns: a logistic score of event and entity facts."""
    ratio = features["amount"] / np.maximum(features["user_stats__avg_amount_7d"], 1.0)
    night = features["hour_of_day"].isin([0, 1, 2, 3, 4]).astype(float)
    logit = (
        -5.0
        + 1.1 * np.log1p(ratio)
        + 25.0 * features["user_stats__chargeback_rate_90d"]
        + 6.0 * features["merchant_stats__risk_score"]
        + 0.9 * features["is_online"].astype(float)
        + 0.8 * night
        - 0.6 * np.log1p(features["user_stats__account_age_days"] / 365.0)
    )
    return 1.0 / (1.0 + np.exp(-logit.to_numpy()))


def user_id(index: int) -> str:
    return f"u{index:07d}"


def merchant_id(index: int) -> str:
    return f"m{index:06d}"


def product_id(index: int) -> str:
    return f"p{index:06d}"
