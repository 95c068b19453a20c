"""`headrace init`: a pipeline stanza to start from, written from an event schema, a
Feast feature service and an ONNX model.

Each model input is matched by name to an event field or a feature (skl2onnx exports
one input per column, named after it); a wider input takes the numeric fields and
features in order when their count fits, else placeholders that `headrace check`
reports. The task follows the outputs: a ZipMap or a probability tensor makes a
classifier (binary with two classes, multiclass with more), a single tensor a
regression.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.config import ModelConfig
from models.session import load_session
from models.signature import ONNX_TYPES, Column, TensorInput
from schemas.catalogue import read_schema_file
from schemas.validation import field_types
from streams.errors import ConfigError

_NUMERIC = {"int", "long", "float", "double", "boolean"}


def stanza(
    name: str, schema_path: Path, model_path: Path, feature_refs: list[str],
    feature_service: str | None, join_keys: list[str],
) -> dict[str, Any]:  # fmt: skip
    schema = read_schema_file(schema_path)
    types = field_types(schema)
    fields = list(types)
    session = load_session(ModelConfig(path=model_path))
    props = session.get_modelmeta().custom_metadata_map
    # Absolute: a config resolves relative paths against its own folder, not where
    # `init` ran, so a stanza pasted into a config elsewhere would point nowhere.
    model: dict[str, Any] = {"path": str(model_path.resolve())}
    if "feature_names" not in props:
        numeric = [f for f in fields if types[f] & _NUMERIC] + list(feature_refs)
        model["inputs"] = [
            _input(port, fields, feature_refs, numeric) for port in session.get_inputs()
        ]
        model["output"] = _output(session)
    spec: dict[str, Any] = {
        "name": name,
        "input_topic": f"{name}-events",
        "output_topic": f"{name}-answers",
        "dead_letter_topic": f"{name}-dlq",
        "input": {
            "schema": str(schema_path.resolve()),
            **({"event_id_field": "event_id"} if "event_id" in fields else {}),
            "validate": {f: ["required"] for f in fields if "null" not in types[f]} or {},
        },
    }
    if feature_service:
        spec["feature_service"] = feature_service
        spec["entity_fields"] = {key: key if key in fields else f"TODO_field_for_{key}"
                                 for key in join_keys}  # fmt: skip
    spec["model"] = model
    spec["latency_budget_ms"] = 100
    return spec


def _input(port, fields: list[str], refs: list[str], numeric: list[str]) -> dict[str, Any]:
    tensor = _tensor(port)
    dtype, width = tensor.dtype, len(tensor.columns)
    if width == 1:
        source = port.name if port.name in fields or port.name in refs else f"TODO_{port.name}"
        columns = [source]
    elif len(numeric) == width:
        columns = numeric
    else:
        columns = [f"TODO_column_{i}" for i in range(width)]
    return {"name": port.name, "dtype": dtype, "columns": columns}


def _output(session) -> dict[str, Any]:
    outputs = session.get_outputs()
    zipmap = next((o for o in outputs if o.type.startswith("seq(map(")), None)
    if zipmap is not None:
        feeds = {port.name: _tensor(port).zeros(1) for port in session.get_inputs()}
        classes = list(session.run([zipmap.name], feeds)[0][0])
        task = "binary" if len(classes) == 2 else "multiclass"
        return {"task": task, "tensor": zipmap.name}
    probabilities = next((o for o in outputs if "prob" in o.name.lower()), None)
    if probabilities is not None:
        width = probabilities.shape[-1] if probabilities.shape else None
        task = "binary" if width in (1, 2) else "multiclass"
        return {"task": task, "tensor": probabilities.name}
    return {"task": "regression", "tensor": outputs[0].name}


def _tensor(port) -> TensorInput:
    dtype = next((d for d, t in ONNX_TYPES.items() if t == port.type), "float32")
    width = port.shape[1] if len(port.shape) == 2 and isinstance(port.shape[1], int) else 1
    return TensorInput(port.name, dtype, tuple(Column(str(i), 0) for i in range(width)))


def feature_service_columns(repo: Path, service_name: str) -> tuple[list[str], list[str]]:
    """The feature refs (`view__feature`) of a Feast feature service of `repo`, and the
    join keys of its views; ConfigError naming the service and those that exist when the
    repo has no such service (a typo, or a repo not applied yet)."""
    from feast.errors import FeastObjectNotFoundException

    from features.store import open_store

    store = open_store(repo)
    try:
        service = store.get_feature_service(service_name)
    except FeastObjectNotFoundException as exc:
        try:
            known = sorted(s.name for s in store.list_feature_services())
        except Exception:  # a registry Feast cannot read at all lists nothing
            known = []
        raise ConfigError(
            f"--feature-service {service_name!r}: no such feature service in {repo} "
            f"(it has: {', '.join(known) or 'none'}); hint: `headrace features prepare` "
            "for the sample repo, or `feast apply` in your own"
        ) from exc
    refs: list[str] = []
    join_keys: list[str] = []
    for projection in service.feature_view_projections:
        refs += [f"{projection.name_to_use()}__{f.name}" for f in projection.features]
        view = store.get_feature_view(projection.name)
        join_keys += [c.name for c in view.entity_columns if c.name not in join_keys]
    return refs, join_keys
