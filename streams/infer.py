"""Infer: the model's input tensors from each event and its feature rows, and the runs.

Each input tensor's columns come from event fields or store features, as the model's
signature says (`models/signature.py`); a missing value (an entity the store does not
have, a null field) takes the column's default. Store features are numbers: a string or
bool column comes from an event field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from features.lookup import FeatureRows
from models.errors import ModelError
from models.pool import SessionPool
from models.session import Feeds
from models.signature import NUMPY_TYPES, Signature, TensorInput
from streams.records import Item


class _Column:
    __slots__ = ("default", "from_store", "source")

    def __init__(self, source: str, default: Any, from_store: bool) -> None:
        self.source = source
        self.default = default
        self.from_store = from_store


class Model:
    """A session pool and where each column of its inputs comes from."""

    def __init__(
        self, pool: SessionPool, event_fields: Sequence[str], feature_refs: Sequence[str]
    ) -> None:
        self.pool = pool
        self.signature: Signature = pool.signature
        problems = self.signature.source_problems(event_fields, feature_refs)
        if problems:
            raise ModelError("\n".join(problems))
        stored = set(feature_refs)
        self._tensors: list[tuple[TensorInput, list[_Column], np.ndarray | None]] = []
        for tensor in self.signature.inputs:
            columns = [_Column(c.source, c.default, c.source in stored) for c in tensor.columns]
            defaults = None
            if tensor.dtype == "float32":
                defaults = np.asarray([c.default for c in columns], dtype=np.float32)
            self._tensors.append((tensor, columns, defaults))
        self.needs_store = any(c.from_store for _, cols, _ in self._tensors for c in cols)
        self.event_sources = [
            c.source for _, cols, _ in self._tensors for c in cols if not c.from_store
        ]

    def feeds(self, items: Sequence[Item], rows: FeatureRows | None) -> Feeds:
        picked = None
        if self.needs_store:
            picked = np.fromiter((item.row for item in items), dtype=np.intp, count=len(items))
        feeds = {}
        for tensor, columns, defaults in self._tensors:
            if defaults is not None:
                feeds[tensor.name] = _numbers(items, rows, picked, columns, defaults)
            else:
                feeds[tensor.name] = _values(items, rows, picked, columns, tensor)
        return feeds

    async def run(self, items: Sequence[Item], rows: FeatureRows | None) -> float:
        """Run the model on `items`, set each one's answer; the run's seconds."""
        answers, seconds = await self.pool.run_timed(self.feeds(items, rows))
        for item, answer in zip(items, answers, strict=True):
            item.answer = answer
        return seconds


def _numbers(items, rows, picked, columns: list[_Column], defaults: np.ndarray) -> np.ndarray:
    """A float32 tensor; NaN (a missing store value or a null field) becomes the default."""
    matrix = np.empty((len(items), len(columns)), dtype=np.float32)
    for index, column in enumerate(columns):
        if column.from_store:
            matrix[:, index] = rows.columns[column.source][picked]
            continue
        values = [item.event[column.source] for item in items]
        try:
            matrix[:, index] = values
        except TypeError:  # a null among them
            matrix[:, index] = [math.nan if v is None else v for v in values]
    missing = np.isnan(matrix)
    if missing.any():
        matrix[missing] = np.broadcast_to(defaults, matrix.shape)[missing]
    return matrix


def _values(items, rows, picked, columns: list[_Column], tensor: TensorInput) -> np.ndarray:
    """An int64, string or bool tensor; a missing value becomes the column's default."""
    out = np.empty((len(items), len(columns)), dtype=NUMPY_TYPES[tensor.dtype])
    for index, column in enumerate(columns):
        default = column.default
        if column.from_store:  # int64 from a numeric feature
            values = rows.columns[column.source][picked]
            out[:, index] = np.where(np.isnan(values), default, values)
            continue
        source = column.source
        out[:, index] = [default if (v := item.event[source]) is None else v for item in items]
    return out
