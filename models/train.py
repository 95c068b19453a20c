"""Train the sample fraud models on the synthetic world and export them to ONNX.

`fraud-mlp` reads the event fields and the `fraud_scoring` feature service, in the
order written to the artifact's metadata. `fraud-lite`, its fallback, is a logistic
regression on the event fields alone: it needs no feature read, so it can still answer
events the full model would answer too late. Needs the `dev` extra (scikit-learn, skl2onnx).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from features.sample_data import SampleWorld, fraud_probability

log = logging.getLogger(__name__)

MODEL_NAME = "fraud-mlp"
MODEL_VERSION = "1"
FALLBACK_NAME = "fraud-lite"
EVENT_FEATURES = ("amount", "hour_of_day", "is_online")
STORE_FEATURES = (
    "user_stats__txn_count_7d",
    "user_stats__avg_amount_7d",
    "user_stats__chargeback_rate_90d",
    "user_stats__account_age_days",
    "merchant_stats__risk_score",
    "merchant_stats__txn_count_7d",
    "merchant_stats__avg_amount_7d",
)
FEATURE_NAMES = EVENT_FEATURES + STORE_FEATURES


def training_frame(world: SampleWorld, n_samples: int, seed: int) -> pd.DataFrame:
    """Events joined with their entity features, as the worker would see them."""
    rng = np.random.default_rng(seed)
    events = world.events(n_samples, rng, now_ms=0)
    users = (
        world.users().add_prefix("user_stats__").rename(columns={"user_stats__user_id": "user_id"})
    )
    merchants = (
        world.merchants()
        .add_prefix("merchant_stats__")
        .rename(columns={"merchant_stats__merchant_id": "merchant_id"})
    )
    frame = events.merge(users, on="user_id", how="left").merge(
        merchants, on="merchant_id", how="left"
    )
    return frame


def fallback_path(model_path: Path) -> Path:
    """Where `train` writes the fallback model: beside the full one."""
    return model_path.with_name(f"{FALLBACK_NAME}.onnx")


def train(out_path: Path, world: SampleWorld, n_samples: int = 40_000, seed: int = 11) -> dict:
    """Fit both models, export the full one to `out_path` and the fallback beside it
    (`fallback_path`), and return a short report (AUC on held-out data)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    frame = training_frame(world, n_samples, seed)
    # Missing entities get the training medians, the same defaults the worker uses.
    defaults = {name: float(frame[name].median()) for name in STORE_FEATURES}
    defaults.update({name: 0.0 for name in EVENT_FEATURES})
    frame = frame.fillna(defaults)
    labels = np.random.default_rng(seed + 1).random(len(frame)) < fraud_probability(frame)

    full = make_pipeline(
        StandardScaler(),
        MLPClassifier(hidden_layer_sizes=(32, 16), max_iter=60, random_state=seed),
    )
    lite = make_pipeline(StandardScaler(), LogisticRegression(max_iter=200))
    report = {
        "positives": float(labels.mean()),
        MODEL_NAME: _fit_and_export(
            full, MODEL_NAME, FEATURE_NAMES, frame, labels, defaults, out_path
        ),
        FALLBACK_NAME: _fit_and_export(
            lite, FALLBACK_NAME, EVENT_FEATURES, frame, labels, defaults, fallback_path(out_path)
        ),
    }
    log.info("trained the sample models: %s", report)
    return report


def _fit_and_export(
    model, name: str, features: tuple[str, ...], frame, labels, defaults, out_path: Path
) -> dict:
    from skl2onnx import to_onnx
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import roc_auc_score

    x = frame[list(features)].to_numpy(dtype=np.float32)
    split = int(len(x) * 0.8)
    with warnings.catch_warnings():
        # A capped number of epochs is deliberate: the sample model only needs to be useful.
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x[:split], labels[:split])
    auc = float(roc_auc_score(labels[split:], model.predict_proba(x[split:])[:, 1]))
    onnx_model = to_onnx(
        model,
        x[:1],
        options={id(model.steps[-1][1]): {"zipmap": False}},
        target_opset={"": 17, "ai.onnx.ml": 3},
    )
    metadata = {
        "model_name": name,
        "model_version": MODEL_VERSION,
        "feature_names": json.dumps(list(features)),
        "feature_defaults": json.dumps([defaults[f] for f in features]),
        "threshold": "0.5",
        "training_auc": f"{auc:.4f}",
    }
    for key, value in metadata.items():
        entry = onnx_model.metadata_props.add()
        entry.key, entry.value = key, value
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(onnx_model.SerializeToString())
    return {"path": str(out_path), "auc": round(auc, 4)}


def held_out(world: SampleWorld, n_samples: int = 10_000, seed: int = 97):
    """(events joined with their features, fraud labels) the sample models never saw,
    drawn like the training data (a seed `train` does not use)."""
    frame = training_frame(world, n_samples, seed)
    labels = np.random.default_rng(seed + 1).random(len(frame)) < fraud_probability(frame)
    return frame, labels
