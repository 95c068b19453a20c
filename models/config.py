"""Configuration of the model stage: the artifact, its sessions, and its inputs and
output when the artifact does not describe them itself (headrace metadata)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from schemas.config import FrozenModel, resolve_path

Dtype = Literal["float32", "int64", "string", "bool"]
Task = Literal["binary", "multiclass", "regression"]
Scalar = float | int | str | bool


class ColumnConfig(FrozenModel):
    source: str = Field(min_length=1, alias="from")
    """An event field (`amount`) or a feature of the pipeline's feature service
    (`view__feature`)."""
    default: Scalar | None = None
    """The value used when the source has none (an entity missing from the store, a
    null field). None: 0, the empty string or false, by the input's dtype."""


class InputTensorConfig(FrozenModel):
    """One input tensor of the model, shaped (batch, len(columns))."""

    name: str = Field(min_length=1)
    """The ONNX input's name."""
    dtype: Dtype = "float32"
    columns: list[ColumnConfig] = Field(min_length=1)
    """Its columns in order; a bare string is a column without a default."""

    @field_validator("columns", mode="before")
    @classmethod
    def _bare_names(cls, columns: object) -> object:
        if isinstance(columns, list):
            return [{"from": c} if isinstance(c, str) else c for c in columns]
        return columns


class OutputConfig(FrozenModel):
    """What the model's answer is, and which output holds it."""

    task: Task
    """`binary`: the probability of one class, and whether it reaches `threshold`;
    `multiclass`: the most probable class and the `top_k` probabilities; `regression`:
    one number."""
    tensor: str | None = Field(None, min_length=1)
    """The output to read: class probabilities (a (batch, classes) tensor, or the
    sequence of maps a skl2onnx ZipMap makes) or, for regression, the values. None: the
    last output for a classifier, the first for regression."""
    classes: list[str] | None = Field(None, min_length=2)
    """Class labels in the order of the probability columns. None: the ZipMap's keys,
    else the classifier's labels in the graph, else the column numbers."""
    positive_class: str | None = None
    """binary: the class whose probability is the score (None: the second class)."""
    threshold: float = Field(0.5, ge=0, le=1)
    """binary: the label is true when the score reaches this."""
    top_k: int = Field(3, ge=1, le=100)
    """multiclass: how many classes each answer lists."""


class ModelRegistryConfig(FrozenModel):
    """Where a model given by name and version comes from (`models/registry.py`)."""

    root: Path = Field(Path("models/registry"), validate_default=True)
    """The folder registry: `<root>/<name>/<version>/model.onnx`, aliases in
    `<root>/<name>/aliases.json` (relative to the config file)."""
    mlflow_uri: str | None = Field(None, pattern=r"^(https?|file|sqlite)://|^databricks")
    """An MLflow tracking server (`http://host:5000`): versions then come from its Model
    Registry (`models:/<name>/<version>`, `models:/<name>@<alias>`) instead of `root`."""
    cache_dir: Path = Field(Path(".headrace/models"), validate_default=True)
    """Where versions downloaded from MLflow are kept (relative to the config file)."""
    timeout_s: float = Field(30.0, gt=0, le=600)
    """Longest one call to the MLflow server may take."""

    _resolve_paths = field_validator("root", "cache_dir")(resolve_path)


class ModelConfig(FrozenModel):
    path: Path | None = None
    """The `.onnx` artifact. None: `name` and `version` are looked up in `registry`."""
    name: str | None = Field(None, min_length=1)
    """The model's name in the registry and in answers (None: from headrace metadata,
    else the file name)."""
    version: str | None = Field(None, min_length=1)
    """The version in the registry (`3`), or an alias (`@champion`); the version in
    answers (None: from headrace metadata, else `1`)."""
    registry: ModelRegistryConfig = Field(default={}, validate_default=True)
    inputs: list[InputTensorConfig] | None = Field(None, min_length=1)
    """Where each input tensor's columns come from. None: from the artifact's headrace
    metadata (one float32 input of its `feature_names`)."""
    output: OutputConfig | None = None
    """None: from headrace metadata (binary, its threshold)."""
    cpu_sessions: int = Field(1, ge=0, le=64)
    """CPU sessions in the pool, each on its own thread."""
    cuda_sessions: int = Field(0, ge=0, le=16)
    """CUDA sessions; each falls back to CPU, with a warning, where CUDA is unusable."""
    intra_op_threads: int = Field(1, ge=1, le=64)
    """ONNX Runtime threads per session; 1 suits a 2-core machine."""

    _resolve_path = field_validator("path")(resolve_path)

    @model_validator(mode="after")
    def _located(self) -> ModelConfig:
        if self.path is None and (self.name is None or self.version is None):
            raise ValueError(
                "needs `path` (an .onnx file), or `name` and `version` (or `@alias`) to "
                "look up in the model registry"
            )
        return self

    @property
    def alias(self) -> str | None:
        """The alias `version` names (`@champion` -> `champion`), else None."""
        return self.version[1:] if self.version and self.version.startswith("@") else None

    @model_validator(mode="after")
    def _some_session(self) -> ModelConfig:
        if self.cpu_sessions + self.cuda_sessions < 1:
            raise ValueError("needs at least one session: cpu_sessions + cuda_sessions >= 1")
        return self
