"""Train the sample click-intent model on the synthetic world and export it to ONNX as a
user would bring one: plain skl2onnx, no headrace metadata in the artifact.

The model is a scikit-learn `Pipeline`: a `ColumnTransformer` (one-hot `page_type`,
unknown pages ignored; standard-scaled `dwell_ms` and the `click_intent` feature
service's `product_stats__<feature>` columns), then a multinomial `LogisticRegression`
over the string classes of `INTENT_CLASSES`. The artifact has one input per column
(`INPUT_NAMES`: `page_type` string, `dwell_ms` int64, the product features float, each
`[None, 1]`) and skl2onnx's default outputs: `output_label` (the class) and
`output_probability` (ZipMap on: a sequence of class -> probability maps). A pipeline
config describes that mapping column by column, since the artifact does not.

Defaults: rows of products missing from Feast are filled with the medians of the
sampled rows (`training_medians`), as the worker fills them from the config.
`INTENT_DEFAULTS` holds those medians for the default `SampleWorld` and training
arguments as literals, so a pipeline config can use them without training (or importing
scikit-learn); a test checks they equal `training_medians`. `train_intent` returns the
medians it used in its report.
Needs the `dev` extra (scikit-learn, skl2onnx).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from features.sample_data import (
    INTENT_CLASSES,
    PRODUCT_FEATURES,
    SampleWorld,
    click_intent_probabilities,
)

log = logging.getLogger(__name__)

MODEL_NAME = "click-intent"
ARTIFACT_NAME = f"{MODEL_NAME}.onnx"
STORE_FEATURES = tuple(f"product_stats__{name}" for name in PRODUCT_FEATURES)
INPUT_NAMES = ("page_type", "dwell_ms", *STORE_FEATURES)
N_SAMPLES = 20_000
SEED = 13
HELD_OUT_SHARE = 0.2

# training_medians(SampleWorld(), N_SAMPLES, SEED): what the worker gives a product
# missing from Feast. Literals so that reading them costs nothing; regenerate them when
# the sample world or the training arguments change (the tests say when).
INTENT_DEFAULTS: dict[str, float] = {
    "product_stats__price": 25.44,
    "product_stats__popularity_7d": 1.7892311811447144,
    "product_stats__conversion_rate_30d": 0.03319421410560608,
    "product_stats__return_rate_90d": 0.07962950319051743,
}


def intent_path(model_path: Path) -> Path:
    """Where the sample assets keep the click-intent model: beside `model_path`."""
    return model_path.with_name(ARTIFACT_NAME)


def training_frame(world: SampleWorld, n_samples: int, seed: int) -> pd.DataFrame:
    """Click events joined with their product's features, as the worker would see them
    (NaN where the product has no row)."""
    events = world.click_events(n_samples, np.random.default_rng(seed), now_ms=0)
    products = world.products().set_index("product_id").add_prefix("product_stats__")
    return events.join(products, on="product_id")


def training_medians(
    world: SampleWorld, n_samples: int = N_SAMPLES, seed: int = SEED
) -> dict[str, float]:
    """The product features' medians over the sampled rows of known products (the
    defaults `fit_intent` fills missing products with)."""
    return _medians(training_frame(world, n_samples, seed))


def _medians(frame: pd.DataFrame) -> dict[str, float]:
    return {name: float(frame[name].median()) for name in STORE_FEATURES}


@dataclass(frozen=True)
class IntentFit:
    """A fitted pipeline with the rows it did not see."""

    pipeline: Any
    held_out: pd.DataFrame
    """The model's input columns (`INPUT_NAMES`) with the dtypes of its ONNX inputs."""
    held_out_labels: np.ndarray
    held_out_truth: np.ndarray
    """The ground-truth probabilities of the held-out rows, in `INTENT_CLASSES` order."""
    defaults: dict[str, float]


def fit_intent(world: SampleWorld, n_samples: int = N_SAMPLES, seed: int = SEED) -> IntentFit:
    """Sample labelled rows from the world's ground truth, fit on the first 80%. Blocks
    for about a second."""
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    frame = training_frame(world, n_samples, seed)
    defaults = _medians(frame)
    rows = frame.fillna(defaults)[list(INPUT_NAMES)].astype(
        {"dwell_ms": np.int64, **dict.fromkeys(STORE_FEATURES, np.float32)}
    )
    truth = click_intent_probabilities(rows)
    draws = np.random.default_rng(seed + 1).random(len(rows))[:, None]
    # Inverse CDF; the minimum guards against a cumulative sum a rounding short of 1.
    classes = np.minimum((draws > truth.cumsum(axis=1)).sum(axis=1), len(INTENT_CLASSES) - 1)
    labels = np.array(INTENT_CLASSES, dtype=object)[classes]

    pipeline = Pipeline(
        [
            (
                "columns",
                ColumnTransformer(
                    [
                        ("page", OneHotEncoder(handle_unknown="ignore"), ["page_type"]),
                        ("numbers", StandardScaler(), ["dwell_ms", *STORE_FEATURES]),
                    ]
                ),
            ),
            ("classifier", LogisticRegression(max_iter=1_000)),
        ]
    )
    split = int(len(rows) * (1 - HELD_OUT_SHARE))
    pipeline.fit(rows.iloc[:split], labels[:split])
    return IntentFit(pipeline, rows.iloc[split:], labels[split:], truth[split:], defaults)


def export_intent(pipeline, out_path: Path) -> None:
    """Plain skl2onnx: one input per column, ZipMap on, no metadata."""
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType, StringTensorType

    initial_types = [
        ("page_type", StringTensorType([None, 1])),
        ("dwell_ms", Int64TensorType([None, 1])),
        *((name, FloatTensorType([None, 1])) for name in STORE_FEATURES),
    ]
    onnx_model = convert_sklearn(
        pipeline, initial_types=initial_types, target_opset={"": 17, "ai.onnx.ml": 3}
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(onnx_model.SerializeToString())


def train_intent(
    out_path: Path, world: SampleWorld, n_samples: int = N_SAMPLES, seed: int = SEED
) -> dict:
    """Fit the click-intent pipeline, export it to `out_path`, and return a short report:
    held-out accuracy and log-loss (with those of the ground truth itself, the best any
    model can do), the defaults used for missing products, and the seconds it took."""
    from sklearn.metrics import accuracy_score, log_loss

    started = time.monotonic()
    fit = fit_intent(world, n_samples, seed)
    export_intent(fit.pipeline, out_path)
    labels = fit.held_out_labels
    probabilities = fit.pipeline.predict_proba(fit.held_out)
    # The ground truth's columns follow INTENT_CLASSES; index them by label directly.
    truth = fit.held_out_truth
    truth_at_label = truth[np.arange(len(labels)), [INTENT_CLASSES.index(c) for c in labels]]
    truth_labels = np.array(INTENT_CLASSES, dtype=object)[truth.argmax(axis=1)]
    report = {
        "path": str(out_path),
        "classes": list(INTENT_CLASSES),
        "accuracy": _rounded(accuracy_score(labels, fit.pipeline.predict(fit.held_out))),
        "log_loss": _rounded(log_loss(labels, probabilities, labels=fit.pipeline.classes_)),
        "truth_accuracy": _rounded(accuracy_score(labels, truth_labels)),
        "truth_log_loss": _rounded(-np.log(truth_at_label).mean()),
        "defaults": fit.defaults,
        "train_s": round(time.monotonic() - started, 2),
    }
    log.info("trained the click-intent model: %s", report)
    return report


def _rounded(value) -> float:
    return round(float(value), 4)
