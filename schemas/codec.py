"""The Confluent wire format: 0x00, a 4-byte big-endian schema id, then the Avro body.

`decode` resolves the writer's schema by id (cached after the first sight) and reads
the body into our reader schema, so producers may evolve their schema compatibly.
Every way a record can be unreadable raises `DecodeError` with a stable reason code.
Resolving an id may ask a registry (blocking HTTP): `unknown_ids` and `learn` let a
caller on an event loop do that part on a thread, so that `decode` never blocks.
"""

from __future__ import annotations

import contextlib
import io
import struct
from collections.abc import Iterable
from typing import Any

import fastavro
from fastavro.read import SchemaResolutionError

from schemas.catalogue import SchemaCatalogue, load_schema
from schemas.errors import DecodeError, SchemaNotFoundError
from schemas.record_writer import NotHandled, compile_writer

MAGIC_BYTE = 0
_HEADER = struct.Struct(">bI")

Schema = str | dict[str, Any]
"""A shipped schema's file name (`transaction.avsc`) or a schema's raw JSON."""


def _raw(schema: Schema) -> dict[str, Any]:
    return load_schema(schema) if isinstance(schema, str) else schema


def schema_id_of(raw: bytes | None) -> int | None:
    """The schema id a framed record names; None when it is not framed."""
    if raw is None or len(raw) < _HEADER.size or raw[0] != MAGIC_BYTE:
        return None
    return _HEADER.unpack_from(raw)[1]


class AvroDecoder:
    """Decodes framed records into dicts of one reader schema (None: each record as its
    writer schema says, e.g. a tool reading any pipeline's answers)."""

    def __init__(self, catalogue: SchemaCatalogue, reader: Schema | None) -> None:
        self._catalogue = catalogue
        self._reader_raw = _raw(reader) if reader is not None else {"name": "its writer schema"}
        self._reader = fastavro.parse_schema(self._reader_raw) if reader is not None else None
        # Per schema id: the parsed writer schema, and the reader schema to resolve it
        # into; None when the writer's is the reader's own JSON (not merely the same
        # canonical form, which drops logical types and defaults): fastavro then skips
        # resolution, which made reads ~4x slower.
        self._writers: dict[int, tuple[Any, Any]] = {}
        self._unknown: dict[int, SchemaNotFoundError] = {}

    def unknown_ids(self, raws: Iterable[bytes | None]) -> set[int]:
        """Schema ids among `raws` not resolved yet (what `learn` would look up)."""
        writers, unknown = self._writers, self._unknown
        ids = {schema_id_of(raw) for raw in raws}
        return {i for i in ids if i is not None and i not in writers and i not in unknown}

    def learn(self, schema_ids: Iterable[int]) -> None:
        """Blocking: resolve these ids through the catalogue. An id the catalogue does not
        know is remembered as unknown (its records dead-letter); RegistryError (the
        registry unreachable) propagates, for the caller to retry."""
        for schema_id in schema_ids:
            with contextlib.suppress(SchemaNotFoundError):  # remembered by `_writer`
                self._writer(schema_id)

    def decode(self, raw: bytes | None) -> dict[str, Any]:
        if raw is None or len(raw) < _HEADER.size:
            got = "a tombstone (no value)" if raw is None else f"{len(raw)} bytes"
            raise DecodeError(
                "truncated",
                f"expected a Confluent-framed Avro record (at least 5 bytes), got {got}",
            )
        magic, schema_id = _HEADER.unpack_from(raw)
        if magic != MAGIC_BYTE:
            raise DecodeError(
                "bad_magic",
                f"expected magic byte 0, got {magic & 0xFF}; "
                "hint: produce with a Confluent Avro serializer",
            )
        writer, reader = self._writer(schema_id)
        body = io.BytesIO(raw)
        body.seek(_HEADER.size)
        try:
            record = fastavro.schemaless_reader(body, writer, reader)
        except SchemaResolutionError as exc:
            raise DecodeError(
                "incompatible_schema",
                f"schema id {schema_id} cannot be read as {self._reader_raw['name']}: {exc}",
            ) from exc
        except (EOFError, StopIteration, IndexError, struct.error) as exc:
            raise DecodeError(
                "truncated", f"Avro body of schema id {schema_id} ended early ({len(raw)} bytes)"
            ) from exc
        except (ValueError, UnicodeDecodeError, OverflowError) as exc:
            raise DecodeError(
                "corrupt", f"Avro body of schema id {schema_id} is not valid: {exc}"
            ) from exc
        if body.tell() != len(raw):
            raise DecodeError(
                "trailing_bytes",
                f"{len(raw) - body.tell()} bytes left after the record of schema id {schema_id}; "
                "hint: the body was written with a different schema than its id names",
            )
        return record

    def _writer(self, schema_id: int) -> tuple[Any, Any]:
        known = self._writers.get(schema_id)
        if known is None:
            if schema_id in self._unknown:
                raise self._unknown[schema_id]
            try:
                raw = self._catalogue.schema_for_id(schema_id)
            except SchemaNotFoundError as exc:
                # Asked once: a reader of many records framed with it (the read-back,
                # the audit) would otherwise ask the registry again for each.
                self._unknown[schema_id] = exc
                raise
            if self._reader is not None and raw == self._reader_raw:
                known = (self._reader, None)
            else:
                known = (fastavro.parse_schema(raw), self._reader)
            self._writers[schema_id] = known
        return known


class AvroEncoder:
    """Encodes dicts of one schema, framed with the id the catalogue gives for `subject`
    (registering it there, with a registry: blocks on HTTP once, when constructed)."""

    def __init__(self, catalogue: SchemaCatalogue, schema: Schema, subject: str) -> None:
        raw = _raw(schema)
        self._schema = fastavro.parse_schema(raw)
        self._write = compile_writer(raw)
        self.schema_id = catalogue.id_for(subject, raw)
        self._header = _HEADER.pack(MAGIC_BYTE, self.schema_id)

    def encode(self, record: dict[str, Any]) -> bytes:
        if self._write is not None:
            out = bytearray(self._header)
            try:
                self._write(out, record)
                return bytes(out)
            except NotHandled:
                pass  # fastavro writes it, or raises its own error
        return self._encode_with_fastavro(record)

    def _encode_with_fastavro(self, record: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        out.write(self._header)
        fastavro.schemaless_writer(out, self._schema, record)
        return out.getvalue()
