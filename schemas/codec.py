"""The Confluent wire format: 0x00, a 4-byte big-endian schema id, then the Avro body.

`decode` resolves the writer's schema by id (cached after the first sight) and reads
the body into our reader schema, so producers may evolve their schema compatibly.
Every way a record can be unreadable raises `DecodeError` with a stable reason code.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import fastavro
from fastavro.read import SchemaResolutionError

from schemas.catalogue import SchemaCatalogue, load_schema, parsed_schema
from schemas.errors import DecodeError

MAGIC_BYTE = 0
_HEADER = struct.Struct(">bI")


class AvroDecoder:
    """Decodes framed records into dicts of one reader schema (a `.avsc` in `schemas/`)."""

    def __init__(self, catalogue: SchemaCatalogue, reader_file: str) -> None:
        self._catalogue = catalogue
        self._reader_raw = load_schema(reader_file)
        self._reader = parsed_schema(reader_file)
        self._writers: dict[int, Any] = {}

    def decode(self, raw: bytes | None) -> dict[str, Any]:
        if raw is None or len(raw) < _HEADER.size:
            size = 0 if raw is None else len(raw)
            raise DecodeError(
                "truncated",
                f"expected a Confluent-framed Avro record (at least 5 bytes), got {size} bytes",
            )
        magic, schema_id = _HEADER.unpack_from(raw)
        if magic != MAGIC_BYTE:
            raise DecodeError(
                "bad_magic",
                f"expected magic byte 0, got {magic & 0xFF}; "
                "hint: produce with a Confluent Avro serializer",
            )
        writer = self._writer(schema_id)
        body = io.BytesIO(raw)
        body.seek(_HEADER.size)
        try:
            record = fastavro.schemaless_reader(body, writer, self._reader)
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

    def _writer(self, schema_id: int) -> Any:
        writer = self._writers.get(schema_id)
        if writer is None:
            writer = fastavro.parse_schema(self._catalogue.schema_for_id(schema_id))
            self._writers[schema_id] = writer
        return writer


class AvroEncoder:
    """Encodes dicts of one schema, framed with the id the catalogue gives for `subject`."""

    def __init__(self, catalogue: SchemaCatalogue, schema_file: str, subject: str) -> None:
        self._schema = parsed_schema(schema_file)
        self._header = _HEADER.pack(MAGIC_BYTE, catalogue.id_for(subject, schema_file))

    def encode(self, record: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        out.write(self._header)
        fastavro.schemaless_writer(out, self._schema, record)
        return out.getvalue()
