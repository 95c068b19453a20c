"""Where schema ids come from: a Confluent-compatible registry, or the local catalogue.

The local catalogue is the embedded default: the `.avsc` files beside this module,
with fixed ids, so the whole demo runs without a registry. With a registry, ids are
looked up (reads) or registered under `<topic>-value` subjects (writes), as
confluent-kafka's own `AvroSerializer` does, so events written by a user's producer
decode here and predictions decode in a user's consumer.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import fastavro

from schemas.errors import RegistryError, SchemaNotFoundError

SCHEMA_DIR = Path(__file__).parent

# Fixed ids of the embedded catalogue. Ids are part of the wire format: never reuse one.
# A changed schema gets a new id; its earlier versions stay in `history/` so records
# written with them still decode.
LOCAL_IDS: dict[int, str] = {
    1: "history/transaction-1.avsc",
    2: "history/prediction-1.avsc",
    3: "transaction.avsc",
    4: "prediction.avsc",
}


@cache
def load_schema(file_name: str) -> dict[str, Any]:
    """The raw (unparsed) JSON of a schema shipped in `schemas/`."""
    return json.loads((SCHEMA_DIR / file_name).read_text())


@cache
def parsed_schema(file_name: str) -> Any:
    return fastavro.parse_schema(load_schema(file_name))


class SchemaCatalogue(Protocol):
    """Resolves writer schemas by id and gives the id to frame our own writes with."""

    def schema_for_id(self, schema_id: int) -> dict[str, Any]:
        """The raw JSON of the schema with this id; raises SchemaNotFoundError."""
        ...

    def id_for(self, subject: str, file_name: str) -> int:
        """The id under which records of `file_name` are framed when written to `subject`."""
        ...


class LocalCatalogue:
    """The embedded default: the schemas shipped in `schemas/`, with fixed ids."""

    def schema_for_id(self, schema_id: int) -> dict[str, Any]:
        file_name = LOCAL_IDS.get(schema_id)
        if file_name is None:
            raise SchemaNotFoundError(schema_id, f"the local catalogue (ids {sorted(LOCAL_IDS)})")
        return load_schema(file_name)

    def id_for(self, subject: str, file_name: str) -> int:
        for schema_id, known in LOCAL_IDS.items():
            if known == file_name:
                return schema_id
        raise SchemaNotFoundError(-1, f"the local catalogue (no id for {file_name})")


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

    def id_for(self, subject: str, file_name: str) -> int:
        from confluent_kafka.schema_registry import Schema

        try:
            return self._client.register_schema(
                subject, Schema(json.dumps(load_schema(file_name)), "AVRO")
            )
        except Exception as exc:
            raise RegistryError(
                f"could not register {file_name} under subject {subject!r} at {self.url}: {exc}"
            ) from exc


def open_catalogue(registry_url: str | None) -> SchemaCatalogue:
    """The registry when a URL is configured, else the embedded local catalogue."""
    return RegistryCatalogue(registry_url) if registry_url else LocalCatalogue()
