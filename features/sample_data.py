"""A deterministic synthetic world for the sample pipeline: users, merchants, payments.

The same seed gives the same entity statistics in every process, so the features
materialized into Feast, the events `headrace produce` sends and the data the sample
model is trained on all describe one world, and the model's scores mean something.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

# Share of sampled events whose user or merchant has no row in Feast, so the
# missing-entity path is exercised by every demo and test.
UNKNOWN_ENTITY_RATE = 0.02


@dataclass(frozen=True)
class SampleWorld:
    n_users: int = 10_000
    n_merchants: int = 1_000
    seed: int = 7

    def users(self) -> pd.DataFrame:
        return self._users.copy()

    def merchants(self) -> pd.DataFrame:
        return self._merchants.copy()

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
