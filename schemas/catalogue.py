"""Where schema ids come from: a Confluent-compatible registry, or the local catalogue.

The local catalogue is the embedded default, so the whole demo runs without a registry:
the `.avsc` files shipped beside this module keep fixed ids, and any other schema (a
pipeline's own input schema, a derived answer schema) gets an id computed from its
Avro parsing canonical form, the same in every process. With a registry, ids are looked
up (reads) or registered under `<topic>-value` subjects (writes), as confluent-kafka's
own `AvroSerializer` does, so events written by a user's producer decode here and
answers decode in a user's consumer.

What a registry answered is also kept in a file (`registry.known_schemas_file`): a
registry id never changes its schema, so a worker restarted while the registry is down
still decodes the ids it met before and frames its answers with the id it was given.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import fastavro
from fastavro.schema import to_parsing_canonical_form

from schemas.config import RegistryConfig
from schemas.errors import (
    RegistryError,
    RegistryUnavailable,
    SchemaFileError,
    SchemaNotFoundError,
)

log = logging.getLogger(__name__)

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


def load_schema(file_name: str) -> dict[str, Any]:
    """The raw (unparsed) JSON of a schema shipped in `schemas/`, a fresh copy per call:
    a caller that changes it changes no one else's."""
    return json.loads(_shipped_text(file_name))


@cache
def _shipped_text(file_name: str) -> str:
    return (SCHEMA_DIR / file_name).read_text()


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


# How long a worker waits for another's merge into the known-schemas file.
LOCK_TIMEOUT_S = 2.0


class KnownSchemas:
    """Ids and schemas a registry gave, kept in a JSON file: `{"ids": {id: schema},
    "subjects": {subject: {schema text: id}}}`. Written whole and renamed into place;
    workers sharing the file merge what they learned, one at a time (a lock file beside
    it): two merging at once each wrote what it had read, and one's entry was lost,
    unknown to a worker restarted while the registry is down. The registry's own
    answers come first: the file stands in only while it cannot answer. No file
    (None): memory only."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self.ids: dict[int, dict[str, Any]] = {}
        self.subjects: dict[str, dict[str, int]] = {}
        self._merge(self._read())

    def remember_id(self, schema_id: int, schema: dict[str, Any]) -> None:
        if self.ids.get(schema_id) != schema:
            self.ids[schema_id] = schema
            self._save()

    def remember_subject(self, subject: str, schema: dict[str, Any], schema_id: int) -> None:
        text = _text(schema)
        if self.subjects.get(subject, {}).get(text) != schema_id:
            self.subjects.setdefault(subject, {})[text] = schema_id
            self.ids[schema_id] = schema
            self._save()

    def id_of(self, subject: str, schema: dict[str, Any]) -> int | None:
        return self.subjects.get(subject, {}).get(_text(schema))

    def _read(self) -> dict[str, Any]:
        if self._path is None or not self._path.exists():
            return {}
        try:
            return json.loads(self._path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring the known-schemas file %s: %s", self._path, exc)
            return {}

    def _merge(self, saved: dict[str, Any]) -> None:
        for schema_id, schema in saved.get("ids", {}).items():
            self.ids.setdefault(int(schema_id), schema)
        for subject, versions in saved.get("subjects", {}).items():
            for text, schema_id in versions.items():
                self.subjects.setdefault(subject, {}).setdefault(text, schema_id)

    def _save(self) -> None:
        if self._path is None:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self._path.with_name(self._path.name + ".lock")):
                self._merge(self._read())  # what other workers learned meanwhile
                data = {"ids": {str(i): s for i, s in self.ids.items()}, "subjects": self.subjects}
                handle, temporary = tempfile.mkstemp(dir=self._path.parent, suffix=".tmp")
                with os.fdopen(handle, "w") as out:
                    json.dump(data, out)
                os.replace(temporary, self._path)
        except OSError as exc:  # a cache: serving goes on without it
            log.warning("could not write the known-schemas file %s: %s", self._path, exc)


@contextmanager
def _locked(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive lock on `path` between processes, released on leaving; OSError when
    another holds it past `timeout_s` (a stuck writer must not stop a worker)."""
    with open(path, "a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise OSError(f"{path} stayed locked for {timeout_s:g} s") from None
                time.sleep(0.01)  # a merge takes milliseconds
        yield  # closing the file releases the lock


def _text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


class RegistryCatalogue:
    """A Confluent-compatible schema registry (Confluent, Apicurio's ccompat API, ...).

    Lookups block on HTTP the first time an id is seen and are cached after that, so
    call it off the event loop or warm it up before traffic.
    """

    def __init__(
        self, url: str, timeout_s: float = 10.0, known_schemas_file: Path | None = None
    ) -> None:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        self.url = url
        # One HTTP request per call, so `timeout_s` bounds it: the client's own retries
        # (3 by default, with backoff) made a registry that never answers cost over 4x it
        # per lookup. The worker retries a failed lookup itself, with backoff.
        self._client = SchemaRegistryClient({"url": url, "timeout": timeout_s, "max.retries": 0})
        self._known = KnownSchemas(known_schemas_file)

    def schema_for_id(self, schema_id: int) -> dict[str, Any]:
        """The registry's schema for `schema_id`; the one kept from before only when the
        registry cannot say (down, or it lost the id): the registry is the truth, and a
        registry started afresh at the same address hands ids out again."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        known = self._known.ids.get(schema_id)
        try:
            schema = self._client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if known is not None and (exc.http_status_code == 404 or not _refusal(exc)):
                return self._kept(schema_id, known, exc)
            if exc.http_status_code == 404:
                raise SchemaNotFoundError(schema_id, f"the registry at {self.url}") from exc
            if not _refusal(exc):  # a 5xx: a proxy before a registry that is down
                raise RegistryUnavailable(
                    f"registry at {self.url} unavailable for id {schema_id}: {exc}"
                ) from exc
            raise RegistryError(f"registry at {self.url} failed for id {schema_id}: {exc}") from exc
        except Exception as exc:  # connection errors come from the HTTP client underneath
            if known is not None:
                return self._kept(schema_id, known, exc)
            raise RegistryUnavailable(
                f"registry at {self.url} unreachable ({_reason(exc)})"
            ) from exc
        raw = json.loads(schema.schema_str)
        self._known.remember_id(schema_id, raw)
        return raw

    def _kept(self, schema_id: int, schema: dict[str, Any], exc: Exception) -> dict[str, Any]:
        log.warning("registry at %s cannot give id %d (%s); using the schema kept for it "
                    "before", self.url, schema_id, _reason(exc))  # fmt: skip
        return schema

    def id_for(self, subject: str, schema: dict[str, Any]) -> int:
        from confluent_kafka.schema_registry import Schema

        try:
            schema_id = self._client.register_schema(subject, Schema(json.dumps(schema), "AVRO"))
        except Exception as exc:
            if _refusal(exc):  # it answered: no outage, and an id kept from before is stale
                raise RegistryError(
                    f"the registry at {self.url} refused {schema.get('name')} under subject "
                    f"{subject!r}: {exc}; hint: the subject's compatibility rules decide "
                    "what it takes"
                ) from exc
            known = self._known.id_of(subject, schema)
            if known is not None:
                log.warning(
                    "registry at %s unreachable (%s); subject %s keeps id %d, as registered "
                    "before", self.url, _reason(exc), subject, known,
                )  # fmt: skip
                return known
            raise RegistryUnavailable(
                f"schema registry at {self.url} could not be reached ({_reason(exc)}) to "
                f"register {schema.get('name')} under subject {subject!r}; hint: is the "
                "registry running? (a local one: `headrace registry start`); once a "
                "schema is registered, workers start without the registry, from "
                "registry.known_schemas_file"
            ) from exc
        self._known.remember_subject(subject, schema, schema_id)
        return schema_id

    def latest(self, subject: str) -> dict[str, Any]:
        """The latest version registered under `subject`."""
        try:
            registered = self._client.get_latest_version(subject)
        except Exception as exc:
            if not _refusal(exc):
                raise RegistryUnavailable(
                    f"schema registry at {self.url} could not be reached ({_reason(exc)}) "
                    f"for the latest version of subject {subject!r}; hint: is the registry "
                    "running? (a local one: `headrace registry start`)"
                ) from exc
            raise RegistryError(
                f"no latest version of subject {subject!r} at {self.url}: {exc}; "
                "hint: register the producers' schema, or set input.schema to an .avsc file"
            ) from exc
        return json.loads(registered.schema.schema_str)


def _refusal(exc: BaseException) -> bool:
    """Whether the registry answered and said no (a 4xx); a 5xx, a timeout or no answer
    at all is an outage (a proxy before a registry that is down answers 502)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    if not isinstance(exc, SchemaRegistryError):
        return False
    status = exc.http_status_code
    return 400 <= status < 500 and status not in (408, 429)


def _reason(exc: BaseException) -> str:
    """The cause of a failed HTTP call alone: `Connection refused` out of requests'
    `HTTPConnectionPool(...): Max retries exceeded ... [Errno 111] Connection refused'))`."""
    text = str(exc)
    errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if errno:
        return errno.group(1).strip()
    if "timed out" in text.lower():
        return "timed out"
    return text or type(exc).__name__


def open_catalogue(registry: RegistryConfig | None) -> SchemaCatalogue:
    """The registry when one is configured, else the embedded local catalogue."""
    if registry is None:
        return LocalCatalogue()
    return RegistryCatalogue(registry.url, registry.timeout_s, registry.known_schemas_file)
