"""Where schema ids come from: a Confluent-compatible registry, or the local catalogue.

The local catalogue is the embedded default, so the whole demo runs without a registry:
the `.avsc` files shipped beside this module keep fixed ids, and any other schema (a
pipeline's own input schema, a derived answer schema) gets an id computed from its
Avro parsing canonical form, the same in every process. With a registry, ids are looked
up (reads) or registered under `<topic>-value` subjects (writes), as confluent-kafka's
own `AvroSerializer` does, so events written by a user's producer decode here and
answers decode in a user's consumer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import fastavro
from fastavro.schema import to_parsing_canonical_form

from schemas.errors import RegistryError, SchemaFileError, SchemaNotFoundError

SCHEMA_DIR = Path(__file__).parent

# Fixed ids of the shipped schemas. Ids are part of the wire format: never reuse one.
# A changed schema gets a new id; its earlier versions stay in `history/` so records
# written with them still decode.
LOCAL_IDS: dict[int, str] = {
    1: "history/transaction-1.avsc",
    2: "history/prediction-1.avsc",
    3: "transaction.avsc",
    4: "prediction.avsc",
}
# Computed ids start here, far from the fixed ones.
_FIRST_COMPUTED_ID = 1 << 20


@cache
def load_schema(file_name: str) -> dict[str, Any]:
    """The raw (unparsed) JSON of a schema shipped in `schemas/`."""
    return json.loads((SCHEMA_DIR / file_name).read_text())


def read_schema_file(path: Path) -> dict[str, Any]:
    """A user's `.avsc`: parsed and checked, or SchemaFileError naming the file."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise SchemaFileError(f"cannot read schema {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise SchemaFileError(f"schema {path} is not JSON: {exc}") from exc
    try:
        fastavro.parse_schema(raw)
    except Exception as exc:  # fastavro raises several kinds for a bad schema
        raise SchemaFileError(f"schema {path} is not a valid Avro schema: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("type") != "record":
        raise SchemaFileError(f"schema {path} must be an Avro record, got {str(raw)[:80]}")
    return raw


def canonical_form(schema: dict[str, Any]) -> str:
    """Avro's parsing canonical form: equal for schemas that read and write alike."""
    return to_parsing_canonical_form(fastavro.parse_schema(schema))


def computed_id(schema: dict[str, Any]) -> int:
    """The local catalogue's id of a schema it does not ship: stable across processes."""
    digest = hashlib.sha256(canonical_form(schema).encode()).digest()
    return _FIRST_COMPUTED_ID + int.from_bytes(digest[:4]) % (2**31 - _FIRST_COMPUTED_ID)


class SchemaCatalogue(Protocol):
    """Resolves writer schemas by id and gives the id to frame our own writes with."""

    def schema_for_id(self, schema_id: int) -> dict[str, Any]:
        """The raw JSON of the schema with this id; raises SchemaNotFoundError. May block
        (a registry lookup) the first time an id is seen."""
        ...

    def id_for(self, subject: str, schema: dict[str, Any]) -> int:
        """The id under which records of `schema` are framed when written to `subject`."""
        ...


class LocalCatalogue:
    """The embedded default: the shipped schemas with fixed ids, and `known` schemas
    (and any later given to `id_for`) with computed ids."""

    def __init__(self, known: Iterable[dict[str, Any]] = ()) -> None:
        self._by_id: dict[int, dict[str, Any]] = {i: load_schema(f) for i, f in LOCAL_IDS.items()}
        self._ids = {canonical_form(s): i for i, s in reversed(self._by_id.items())}
        for schema in known:
            self.id_for("", schema)

    def schema_for_id(self, schema_id: int) -> dict[str, Any]:
        schema = self._by_id.get(schema_id)
        if schema is None:
            raise SchemaNotFoundError(schema_id, f"the local catalogue (ids {sorted(self._by_id)})")
        return schema

    def id_for(self, subject: str, schema: dict[str, Any]) -> int:
        form = canonical_form(schema)
        schema_id = self._ids.get(form)
        if schema_id is None:
            schema_id = self._ids[form] = computed_id(schema)
            self._by_id[schema_id] = schema
        return schema_id


class RegistryCatalogue:
    """A Confluent-compatible schema registry (Confluent, Apicurio's ccompat API, ...).

    Lookups block on HTTP the first time an id is seen and are cached after that, so
    call it off the event loop or warm it up before traffic.
    """

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        self.url = url
        self._client = SchemaRegistryClient({"url": url, "timeout": timeout_s})
        self._by_id: dict[int, dict[str, Any]] = {}

    def schema_for_id(self, schema_id: int) -> dict[str, Any]:
        cached = self._by_id.get(schema_id)
        if cached is not None:
            return cached
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            schema = self._client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise SchemaNotFoundError(schema_id, f"the registry at {self.url}") from exc
            raise RegistryError(f"registry at {self.url} failed for id {schema_id}: {exc}") from exc
        except Exception as exc:  # connection errors come from the HTTP client underneath
            raise RegistryError(f"registry at {self.url} unreachable: {exc}") from exc
        raw = json.loads(schema.schema_str)
        self._by_id[schema_id] = raw
        return raw

    def id_for(self, subject: str, schema: dict[str, Any]) -> int:
        from confluent_kafka.schema_registry import Schema

        try:
            return self._client.register_schema(subject, Schema(json.dumps(schema), "AVRO"))
        except Exception as exc:
            raise RegistryError(
                f"could not register {schema.get('name')} under subject {subject!r} "
                f"at {self.url}: {exc}"
            ) from exc

    def latest(self, subject: str) -> dict[str, Any]:
        """The latest version registered under `subject`."""
        try:
            registered = self._client.get_latest_version(subject)
        except Exception as exc:
            raise RegistryError(
                f"no latest version of subject {subject!r} at {self.url}: {exc}; "
                "hint: register the producers' schema, or set input.schema to an .avsc file"
            ) from exc
        return json.loads(registered.schema.schema_str)


def open_catalogue(registry_url: str | None) -> SchemaCatalogue:
    """The registry when a URL is configured, else the embedded local catalogue."""
    return RegistryCatalogue(registry_url) if registry_url else LocalCatalogue()
