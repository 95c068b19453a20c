"""Configuration of the schema stage: the registry and each pipeline's input.

Also the base of every package's config model (frozen, no unknown keys) and the
resolution of relative paths against the config file's folder: `schemas/` is the
bottom layer, so the other packages take them from here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class FrozenModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def resolve_path(path: Path | None, info: ValidationInfo) -> Path | None:
    """A relative path taken from the folder of the config file (context `base_dir`)."""
    base = (info.context or {}).get("base_dir")
    if path is None or path.is_absolute() or base is None:
        return path
    return (base / path).resolve()


class RegistryConfig(FrozenModel):
    url: str = Field(pattern=r"^https?://")
    """Base URL of a Confluent-compatible API (Apicurio: `.../apis/ccompat/v7`)."""
    timeout_s: float = Field(10.0, gt=0, le=300)
    """Longest one registry call may take."""
    known_schemas_file: Path | None = Field(
        Path(".headrace/known-schemas.json"), validate_default=True
    )
    """Where the ids and schemas the registry gave are kept (relative to the config
    file), so that a worker restarted while the registry is down decodes the ids it met
    before and keeps its answers' id. None: memory only."""

    _resolve_known = field_validator("known_schemas_file")(resolve_path)


Bound = int | float


class FieldRules(FrozenModel):
    """Checks of one event field beyond its Avro type; a failing event is dead-lettered
    with reason `invalid_field` and the rule's name."""

    required: bool = False
    """Present and not null (for a field whose type allows null)."""
    non_empty: bool = False
    """A string, array or map with at least one element."""
    min: Bound | None = None
    """Smallest allowed number (inclusive)."""
    max: Bound | None = None
    """Largest allowed number (inclusive)."""
    finite: bool = False
    """Not NaN and not infinite."""
    one_of: list[str | int | float | bool] | None = Field(None, min_length=1)
    """The allowed values."""

    @model_validator(mode="before")
    @classmethod
    def _flags(cls, data: object) -> object:
        # `[required, non_empty]` is short for `{required: true, non_empty: true}`.
        if isinstance(data, list) and all(isinstance(flag, str) for flag in data):
            return dict.fromkeys(data, True)
        return data

    @model_validator(mode="after")
    def _range(self) -> FieldRules:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class InputConfig(FrozenModel):
    """The events of a pipeline's input topic: their schema and what makes one usable."""

    schema_path: Path | None = Field(None, alias="schema")
    """The `.avsc` the events are read as (the reader schema). Producers may write any
    compatible version of it (a writer schema resolved by id)."""
    subject: str | None = Field(None, min_length=1)
    """With a registry: take the latest version registered under this subject as the
    reader schema (e.g. `transactions-value`), instead of `schema`."""
    event_id_field: str | None = Field(None, min_length=1)
    """Field naming the event, copied into its answer (None: answers are identified by
    input topic, partition and offset, which every answer carries)."""
    event_time_field: str | None = Field(None, min_length=1)
    """Field with the event time in epoch milliseconds: the deadline counts from it
    (None: from the record's Kafka timestamp)."""
    validate_fields: dict[str, FieldRules] = Field(default_factory=dict, alias="validate")
    """Per field, the rules an event must pass (`headrace check` lists them)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    _resolve_schema = field_validator("schema_path")(resolve_path)

    @model_validator(mode="after")
    def _one_source(self) -> InputConfig:
        if (self.schema_path is None) == (self.subject is None):
            raise ValueError(
                "give the events' schema as exactly one of `schema` (an .avsc file) or "
                "`subject` (the latest version in the registry)"
            )
        return self
