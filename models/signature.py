"""What a model takes and what it answers: resolved once, from the pipeline's config
or the artifact's headrace metadata, and checked against the ONNX graph.

A model input is a tensor of one dtype shaped (batch, columns); each column comes from
an event field or a feature of the pipeline's feature service, with a default for a
missing value. The output is read by task: `binary` (the probability of one class, and
whether it reaches a threshold), `multiclass` (the most probable class and the top-k
probabilities) or `regression` (one number). Probabilities may come as a tensor or as
the sequence of maps a skl2onnx ZipMap makes. Every mismatch is reported at once, each
naming the input or output and listing what the model has.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.config import Dtype, ModelConfig, OutputConfig, Scalar, Task
from models.errors import ModelError

# ONNX type strings of the dtypes a column tensor may have.
ONNX_TYPES: dict[Dtype, str] = {
    "float32": "tensor(float)",
    "int64": "tensor(int64)",
    "string": "tensor(string)",
    "bool": "tensor(bool)",
}
NUMPY_TYPES: dict[Dtype, Any] = {
    "float32": np.float32, "int64": np.int64, "string": object, "bool": np.bool_,
}  # fmt: skip
_ZERO: dict[Dtype, Scalar] = {"float32": 0.0, "int64": 0, "string": "", "bool": False}


@dataclass(frozen=True)
class Column:
    source: str
    default: Scalar


@dataclass(frozen=True)
class TensorInput:
    name: str
    dtype: Dtype
    columns: tuple[Column, ...]

    def zeros(self, rows: int) -> np.ndarray:
        """A (rows, columns) tensor of zero values: the warm-up feed."""
        return np.full((rows, len(self.columns)), _ZERO[self.dtype], NUMPY_TYPES[self.dtype])


@dataclass(frozen=True)
class ModelOutput:
    task: Task
    tensor: str
    """The output read."""
    zipmap: bool
    """Whether it is a sequence of {class: probability} maps (skl2onnx ZipMap)."""
    classes: tuple[str, ...] | None
    """Class labels by probability column; None until known (a ZipMap tells at warm-up)."""
    positive_class: str | None
    threshold: float
    top_k: int
    zipmap_keys: tuple | None = None
    """The ZipMap's keys in the order of `classes` (int64 keys for integer labels)."""

    def answers(self, value: Any, rows: int) -> list[dict[str, Any]]:
        """The answer fields (`schemas/answer.py`) of each row, from the output read."""
        if self.task == "regression":
            values = np.asarray(value, dtype=np.float64).reshape(rows, -1)[:, 0]
            return [{"value": v} for v in values.tolist()]
        probabilities = self._matrix(value)
        if probabilities.shape[0] != rows:
            raise ModelError(f"model returned {probabilities.shape[0]} rows for {rows}")
        if self.task == "binary":
            column = 0 if probabilities.shape[1] == 1 else self._positive_column()
            threshold = self.threshold
            return [{"score": s, "label": s >= threshold}
                    for s in probabilities[:, column].tolist()]  # fmt: skip
        classes = self.classes or tuple(str(i) for i in range(probabilities.shape[1]))
        k = min(self.top_k, probabilities.shape[1])
        order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
        # A row with a class that is not a number has no best class (argsort puts NaN
        # last): its score is NaN, so that the answer is not OK (`finite_answer`).
        finite = np.isfinite(probabilities).all(axis=1).tolist()
        out = []
        for row, best, usable in zip(probabilities.tolist(), order.tolist(), finite, strict=True):
            top = [{"label": classes[c], "probability": row[c]} for c in best]
            score = top[0]["probability"] if usable else math.nan
            out.append({"label": top[0]["label"], "score": score, "top_classes": top})
        return out

    def unanswered(self) -> dict[str, Any]:
        """The answer fields of an event no model answered (SHED)."""
        return {
            "binary": {"score": math.nan, "label": False},
            "multiclass": {"label": None, "score": math.nan, "top_classes": []},
            "regression": {"value": math.nan},
        }[self.task]

    def fixed(self, value: float) -> dict[str, Any]:
        """The answer fields of a configured default answer (binary, regression)."""
        if self.task == "binary":
            return {"score": value, "label": value >= self.threshold}
        return {"value": value}

    def _matrix(self, value: Any) -> np.ndarray:
        if not self.zipmap:
            matrix = np.asarray(value, dtype=np.float32)
            return matrix.reshape(matrix.shape[0], -1)
        keys = self.zipmap_keys
        return np.array([[row[k] for k in keys] for row in value], dtype=np.float32)

    def _positive_column(self) -> int:
        if self.positive_class is None:
            return 1
        return self.classes.index(self.positive_class)

    def learn_classes(self, value: Any) -> ModelOutput:
        """Checked against a first run's output: class labels from a ZipMap's keys where
        none were given (labels are strings; integer keys too), and as many classes as a
        probability tensor has columns."""
        if not self.zipmap:
            if self.task == "regression" or self.classes is None:
                return self
            width = np.asarray(value).reshape(len(value), -1).shape[1]
            if width != len(self.classes):
                raise ModelError(
                    f"output.classes names {len(self.classes)} classes, the output "
                    f"{self.tensor!r} has {width} probability columns"
                )
            return self
        raw_keys = tuple(value[0]) if len(value) else ()
        by_label = {str(k): k for k in raw_keys}
        given = self.classes
        if given is not None and set(given) != set(by_label):
            raise ModelError(
                f"output.classes {list(given)} differ from the model's {list(by_label)}"
            )
        classes = given or tuple(by_label)
        keys = tuple(by_label[c] for c in classes)
        output = dataclasses.replace(self, classes=classes, zipmap_keys=keys)
        if output.positive_class is not None and output.positive_class not in output.classes:
            raise ModelError(
                f"output.positive_class {output.positive_class!r} is not a class of the "
                f"model (classes: {list(output.classes)})"
            )
        return output


@dataclass(frozen=True)
class Signature:
    name: str
    version: str
    inputs: tuple[TensorInput, ...]
    output: ModelOutput

    @property
    def sources(self) -> list[str]:
        """Every column's source, in order, without repeats."""
        return list(dict.fromkeys(c.source for i in self.inputs for c in i.columns))

    def source_problems(
        self, event_fields: Sequence[str], feature_refs: Sequence[str]
    ) -> list[str]:
        """A problem per column whose source is neither an event field nor a feature,
        or is a (numeric) store feature feeding a string or bool input."""
        known = set(event_fields) | set(feature_refs)
        problems = []
        for tensor in self.inputs:
            for column in tensor.columns:
                where = f"model {self.name}: input {tensor.name!r} column {column.source!r}"
                if column.source not in known:
                    close = difflib.get_close_matches(column.source, sorted(known), n=1)
                    hint = (
                        f"did you mean {close[0]!r}?"
                        if close
                        else "name an event field or a feature in model.inputs, or add it "
                        "to the input schema or the feature service"
                    )
                    problems.append(
                        f"{where} is neither a field of the event ({list(event_fields)}) nor "
                        f"a feature of the pipeline's feature service ({list(feature_refs)}); "
                        f"hint: {hint}"
                    )
                elif column.source in feature_refs and tensor.dtype in ("string", "bool"):
                    problems.append(
                        f"{where} is a store feature, which is a number; a {tensor.dtype} "
                        "column must come from an event field"
                    )
        return problems

    def describe(self) -> list[str]:
        lines = []
        for tensor in self.inputs:
            lines.append(f"input {tensor.name} ({tensor.dtype}, {len(tensor.columns)} columns)")
            lines += [f"  {c.source} (default {c.default!r})" for c in tensor.columns]
        out = self.output
        lines.append(
            f"output {out.tensor}: {out.task}"
            + (f", classes {list(out.classes)}" if out.classes else "")
            + (f", threshold {out.threshold}" if out.task == "binary" else "")
            + (f", top {out.top_k}" if out.task == "multiclass" else "")
        )
        return lines


@dataclass(frozen=True)
class GraphPort:
    """An input or output of the ONNX graph, as ONNX Runtime reports it."""

    name: str
    type: str
    shape: tuple


def resolve(
    config: ModelConfig,
    graph_inputs: Sequence[GraphPort],
    graph_outputs: Sequence[GraphPort],
    metadata: Mapping[str, str],
) -> Signature:
    """The model's signature; ModelError lists every mismatch with the graph."""
    path = config.path
    headrace = _from_metadata(path, metadata) if "feature_names" in metadata else None
    if config.inputs is None and headrace is None:
        raise ModelError(
            f"{path} carries no headrace metadata, so the config must describe its inputs: "
            f"set model.inputs (the model's inputs: {_ports(graph_inputs)}) and model.output "
            f"(its outputs: {_ports(graph_outputs)})"
        )
    if config.inputs is not None:
        inputs = tuple(
            TensorInput(t.name, t.dtype, tuple(
                Column(c.source, _ZERO[t.dtype] if c.default is None else c.default)
                for c in t.columns))
            for t in config.inputs
        )  # fmt: skip
    else:
        names, defaults, _ = headrace
        columns = tuple(Column(n, d) for n, d in zip(names, defaults, strict=True))
        inputs = (TensorInput(graph_inputs[0].name, "float32", columns),)
    output_config = config.output
    if output_config is None:
        if headrace is None:
            raise ModelError(
                f"{path} carries no headrace metadata: set model.output (task and tensor; "
                f"the model's outputs: {_ports(graph_outputs)})"
            )
        output_config = OutputConfig(task="binary", threshold=headrace[2])
    problems = _input_problems(inputs, graph_inputs, from_metadata=config.inputs is None)
    problems += _default_problems(inputs)
    output, output_problems = _output(output_config, graph_outputs)
    problems += output_problems
    if problems:
        described_by = "its config" if config.inputs is not None else "its metadata"
        raise ModelError(
            f"model {path.name} does not fit {described_by}:\n  " + "\n  ".join(problems)
        )
    name = config.name or metadata.get("model_name") or path.stem
    version = config.version or metadata.get("model_version") or "1"
    return Signature(name, version, inputs, output)


def _from_metadata(path: Path, props: Mapping[str, str]) -> tuple[list[str], list[float], float]:
    try:
        names = list(json.loads(props["feature_names"]))
        defaults = [float(v) for v in json.loads(props["feature_defaults"])]
        threshold = float(props.get("threshold", "0.5"))
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelError(
            f"{path} has malformed headrace metadata ({exc}); expected feature_names and "
            "feature_defaults as JSON lists; hint: export with `headrace models train`, or "
            "describe the model with model.inputs and model.output"
        ) from exc
    if len(names) != len(defaults):
        raise ModelError(f"{path}: {len(names)} feature_names but {len(defaults)} defaults")
    return names, defaults, threshold


def _ports(ports: Sequence[GraphPort]) -> str:
    return ", ".join(f"{p.name} {p.type} {list(p.shape)}" for p in ports) or "none"


def _input_problems(
    inputs: Sequence[TensorInput], graph: Sequence[GraphPort], from_metadata: bool = False
) -> list[str]:
    by_name = {port.name: port for port in graph}
    problems = []
    for tensor in inputs:
        port = by_name.get(tensor.name)
        if port is None:
            problems.append(
                f"input {tensor.name!r} is not an input of the model (inputs: {_ports(graph)})"
            )
            continue
        if port.type != ONNX_TYPES[tensor.dtype]:
            problems.append(
                f"input {tensor.name!r} is {port.type} in the model, but its config says "
                f"dtype {tensor.dtype} ({ONNX_TYPES[tensor.dtype]}); hint: set dtype to "
                f"{_dtype_of(port.type) or 'a supported type'}"
            )
        width = port.shape[1] if len(port.shape) == 2 else None
        if len(port.shape) != 2:
            problems.append(f"input {tensor.name!r} has shape {list(port.shape)}: expected 2-D")
        elif isinstance(width, int) and width != len(tensor.columns):
            given = f"{len(tensor.columns)} ({[c.source for c in tensor.columns]})"
            problems.append(
                f"input {tensor.name!r} takes {width} columns, its metadata's feature_names "
                f"give {given}; hint: export the model again, or describe its inputs in "
                "model.inputs"
                if from_metadata
                else f"input {tensor.name!r} takes {width} columns, the config gives {given}"
            )
    configured = {tensor.name for tensor in inputs}
    problems += [
        f"model input {port.name!r} ({port.type}) has no source: add it to model.inputs"
        for port in graph
        if port.name not in configured
    ]
    return problems


def batch_problems(model_name: str, graph: Sequence[GraphPort], max_batch_size: int) -> list[str]:
    """Inputs whose batch dimension is fixed below `max_batch_size`: ONNX Runtime refuses
    any other row count (the worker's warm-up would fail on the first larger batch)."""
    return [
        f"model {model_name}: input {port.name!r} has a fixed batch dimension of "
        f"{port.shape[0]}, but max_batch_size is {max_batch_size}; hint: export the model "
        f"with a dynamic batch axis, or set max_batch_size to {port.shape[0]}"
        for port in graph
        if port.shape and isinstance(port.shape[0], int) and port.shape[0] < max_batch_size
    ]


def _default_problems(inputs: Sequence[TensorInput]) -> list[str]:
    fits = {
        "float32": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "int64": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
    }
    return [
        f"input {t.name!r} column {c.source!r}: default {c.default!r} is not a {t.dtype}"
        for t in inputs
        for c in t.columns
        if not fits[t.dtype](c.default)
    ]


def _dtype_of(onnx_type: str) -> str | None:
    return next((d for d, t in ONNX_TYPES.items() if t == onnx_type), None)


def _output(config: OutputConfig, graph: Sequence[GraphPort]) -> tuple[ModelOutput, list[str]]:
    if config.tensor is not None:
        port = next((p for p in graph if p.name == config.tensor), None)
        if port is None:
            problem = (
                f"output.tensor {config.tensor!r} is not an output of the model "
                f"(outputs: {_ports(graph)})"
            )
            return _dummy(config), [problem]
    elif graph:
        port = graph[0] if config.task == "regression" else graph[-1]
    else:
        return _dummy(config), ["the model has no outputs"]
    zipmap = port.type.startswith("seq(map(")
    problems = []
    if config.task == "regression" and not port.type.startswith("tensor("):
        problems.append(f"output {port.name!r} is {port.type}: regression reads a tensor")
    if config.task != "regression" and not (
        zipmap or port.type in ("tensor(float)", "tensor(double)")
    ):
        problems.append(
            f"output {port.name!r} is {port.type}: a {config.task} task reads class "
            f"probabilities (a float tensor or a ZipMap); outputs: {_ports(graph)}"
        )
    classes = tuple(config.classes) if config.classes else None
    positive = config.positive_class
    if positive is not None and classes is not None and not zipmap and positive not in classes:
        problems.append(
            f"output.positive_class {positive!r} is not in output.classes {list(classes)}"
        )
    if config.positive_class is not None and classes is None and not zipmap:
        problems.append("output.positive_class needs output.classes for a tensor output")
    output = ModelOutput(
        config.task, port.name, zipmap, classes, config.positive_class, config.threshold,
        config.top_k,
    )  # fmt: skip
    return output, problems


def _dummy(config: OutputConfig) -> ModelOutput:
    return ModelOutput(config.task, "", False, None, None, config.threshold, config.top_k)
