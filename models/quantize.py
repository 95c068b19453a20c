"""Quantized variants: an int8 copy of a float model, and a report of what it costs.

`quantize` applies ONNX Runtime's dynamic quantization (weights stored as int8 ahead of
time, activations quantized per batch at run time: no calibration data needed); the
metadata (feature names, defaults, threshold) is kept, so a pipeline serves the copy
unchanged, as its model or as its fallback rung. `report` scores both models on one
held-out set (binary: AUC of the score; multiclass: accuracy of the label; regression:
mean absolute error) and times one run at each batch size. Everything here blocks.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import numpy as np

from models.config import ModelConfig
from models.errors import ModelError
from models.session import ModelSession

BATCH_SIZES = (1, 32, 256)
_RUNS = 30
"""Runs timed at each batch size (the median is reported)."""


def quantize(source: Path, out: Path) -> Path:
    """Write the int8 version of the ONNX model `source` to `out`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out.parent.mkdir(parents=True, exist_ok=True)
    # It suggests a pre-processing pass on the root logger; for these graphs it changes nothing.
    quiet = logging.getLogger()
    level, quiet.level = quiet.level, logging.ERROR
    try:
        quantize_dynamic(source, out, weight_type=QuantType.QInt8)
    except Exception as exc:
        raise ModelError(f"{source} could not be quantized: {exc}") from exc
    finally:
        quiet.level = level
    return out


def report(float_model: Path, int8_model: Path, frame, labels: np.ndarray) -> dict:
    """Both models' metric on `frame` (a DataFrame holding every input column of the
    model; missing values take the column's default) against `labels`, the int8
    model's change in it, and each model's median batch latency in ms."""
    out: dict = {"held_out_rows": len(labels), "batch_latency_ms": {}}
    for role, path in (("float", float_model), ("int8", int8_model)):
        session = ModelSession(ModelConfig(path=path))
        try:
            metric, value = _score(session, frame, labels)
            out[f"{metric}_{role}"] = round(value, 4)
            out["batch_latency_ms"][role] = {
                str(size): round(_latency_ms(session, size), 4) for size in BATCH_SIZES
            }
        finally:
            session.close()
    out["metric"] = metric
    out[f"{metric}_change"] = round(out[f"{metric}_int8"] - out[f"{metric}_float"], 4)
    return out


def _feeds(session: ModelSession, frame) -> dict[str, np.ndarray]:
    feeds = {}
    for tensor in session.signature.inputs:
        names = [column.source for column in tensor.columns]
        missing = [name for name in names if name not in frame.columns]
        if missing:
            raise ModelError(
                f"the held-out set has no column {missing} that {session.signature.name} "
                f"reads; expected {names} and a label column"
            )
        defaults = {column.source: column.default for column in tensor.columns}
        values = frame[names].fillna(defaults).to_numpy()
        feeds[tensor.name] = values.astype(tensor.zeros(0).dtype)
    return feeds


def _score(session: ModelSession, frame, labels: np.ndarray) -> tuple[str, float]:
    from sklearn.metrics import accuracy_score, mean_absolute_error, roc_auc_score

    answers = session.run(_feeds(session, frame))
    task = session.signature.output.task
    if task == "binary":
        return "auc", float(roc_auc_score(labels, [a["score"] for a in answers]))
    if task == "regression":
        return "mae", float(mean_absolute_error(labels, [a["value"] for a in answers]))
    return "accuracy", float(accuracy_score(labels, [a["label"] for a in answers]))


def _latency_ms(session: ModelSession, rows: int) -> float:
    feeds = session.zero_feeds(rows)
    session.run(feeds)  # warm at this size
    runs = []
    for _ in range(_RUNS):
        started = time.perf_counter()
        session.run(feeds)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * 1000
