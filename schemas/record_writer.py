"""Avro binary encoding of one record schema, compiled once into plain functions.

Every answer a worker writes is encoded with its pipeline's answer schema, and
fastavro's `schemaless_writer` spends about half of each call (8 µs for a sample
answer) setting up: schema lookups, an encoder object, an options dict, a union's
branch search. Here the schema becomes one writer function per field, chosen once:
the sample answer takes 4-5 µs, and a string seen before (a topic, a model name, a
status) is encoded once.

fastavro stays the reference. A value this path was not built for (another Python
type, such as a numpy scalar; a number out of range; an absent field without a default
this path can write) raises `NotHandled`, and the caller encodes that record with
fastavro, which writes it or raises its own error. An absent field with a default (an
optional field a producer leaves out) is written here, as fastavro would write it.
So this path never writes what fastavro would write differently or refuse. It covers
what answer schemas hold: null, boolean, int, long, float, double, string, bytes,
enums, records, arrays, maps, and unions of null with one other type. A schema with
anything else (logical types, fixed, wider unions) is not compiled (`compile_writer`
returns None): fastavro writes all of its records.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

Writer = Callable[[bytearray, Any], None]
"""Appends the encoding of a value to the buffer; raises NotHandled."""

_INT_RANGE = range(-(2**31), 2**31)
_LONG_RANGE = range(-(2**63), 2**63)
_PACK_FLOAT = struct.Struct("<f").pack
_PACK_DOUBLE = struct.Struct("<d").pack
# Strings kept encoded, with their length prefix: most of an answer's strings repeat.
_MAX_KNOWN_STRINGS = 4_096
_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "string", "bytes"}
# Names fastavro's writer would take for a type of its own, if a schema named a type so.
_RESERVED_NAMES = _PRIMITIVES | {"record", "error", "enum", "array", "map", "fixed", "union",
                                 "request"}  # fmt: skip


class NotHandled(Exception):
    """A value outside what the compiled path writes: let fastavro encode the record."""


class _Unsupported(Exception):
    """A schema outside what this module compiles."""


def compile_writer(schema: dict[str, Any]) -> Writer | None:
    """The writer of records of `schema` (Avro JSON, not fastavro's parsed form); None
    when the schema holds a type this module does not cover."""
    if not isinstance(schema, dict):
        return None
    try:
        return _Compiler(schema.get("namespace", "")).writer(schema, "")
    except _Unsupported:
        return None


def _varint(out: bytearray, zigzagged: int) -> None:
    while zigzagged >= 0x80:
        out.append((zigzagged & 0x7F) | 0x80)
        zigzagged >>= 7
    out.append(zigzagged)


def _write_long(out: bytearray, value: Any) -> None:
    if type(value) is not int or value not in _LONG_RANGE:  # bool and numpy: fastavro's
        raise NotHandled
    _varint(out, (value << 1) ^ (value >> 63))


def _write_int(out: bytearray, value: Any) -> None:
    if type(value) is not int or value not in _INT_RANGE:
        raise NotHandled
    _varint(out, (value << 1) ^ (value >> 63))


def _write_count(out: bytearray, count: int) -> None:
    _varint(out, count << 1)  # a block's item count: a long, never negative here


def _write_null(_out: bytearray, value: Any) -> None:
    if value is not None:
        raise NotHandled


def _write_boolean(out: bytearray, value: Any) -> None:
    if type(value) is not bool:
        raise NotHandled
    out.append(1 if value else 0)


def _number(value: Any) -> float:
    if type(value) is not float and type(value) is not int:  # fastavro: float(value)
        raise NotHandled
    return value


def _write_float(out: bytearray, value: Any) -> None:
    try:
        out += _PACK_FLOAT(_number(value))
    except (OverflowError, struct.error):  # beyond float32: fastavro's cast decides
        raise NotHandled from None


def _write_double(out: bytearray, value: Any) -> None:
    try:
        out += _PACK_DOUBLE(_number(value))
    except (OverflowError, struct.error):  # an int beyond a double
        raise NotHandled from None


def _write_bytes(out: bytearray, value: Any) -> None:
    if type(value) is not bytes:
        raise NotHandled
    _write_count(out, len(value))  # a length is zigzagged like any long
    out += value


class _Strings:
    """Strings with their encoding kept: most of an answer's strings repeat."""

    def __init__(self) -> None:
        self._known: dict[str, bytes] = {}

    def write(self, out: bytearray, value: Any) -> None:
        encoded = self._known.get(value) if type(value) is str else None
        if encoded is None:
            encoded = self._encode(value)
        out += encoded

    def _encode(self, value: Any) -> bytes:
        if type(value) is not str:
            raise NotHandled
        try:
            text = value.encode()
        except UnicodeEncodeError:  # lone surrogates: fastavro's error
            raise NotHandled from None
        prefix = bytearray()
        _write_count(prefix, len(text))
        encoded = bytes(prefix) + text
        if len(self._known) >= _MAX_KNOWN_STRINGS:
            # Unique strings (event ids) fill it: start again, so the repeated ones come back.
            self._known.clear()
        self._known[value] = encoded
        return encoded


_SIMPLE: dict[str, Writer] = {
    "null": _write_null,
    "boolean": _write_boolean,
    "int": _write_int,
    "long": _write_long,
    "float": _write_float,
    "double": _write_double,
    "bytes": _write_bytes,
}


def _has_default(field: dict[str, Any]) -> bool:
    """Whether fastavro writes something for the field when a record lacks it (its
    writer's own test: a declared default, or "null" in the field's type)."""
    return "default" in field or "null" in field["type"]


class _Compiler:
    def __init__(self, namespace: str) -> None:
        self._namespace = namespace
        self._named: dict[str, Writer] = {}
        self._strings = _Strings()

    def writer(self, schema: Any, namespace: str) -> Writer:
        if isinstance(schema, str):
            if schema == "string":
                return self._strings.write
            if schema in _SIMPLE:
                return _SIMPLE[schema]
            return self._reference(schema, namespace)
        if isinstance(schema, list):
            return self._union(schema, namespace)
        if not isinstance(schema, dict) or "logicalType" in schema:
            raise _Unsupported
        kind = schema.get("type")
        if kind in _PRIMITIVES:
            return self.writer(kind, namespace)
        if kind == "record":
            return self._record(schema, namespace)
        if kind == "enum":
            return self._enum(schema, namespace)
        if kind == "array":
            return self._array(self.writer(schema["items"], namespace))
        if kind == "map":
            return self._map(self.writer(schema["values"], namespace))
        raise _Unsupported  # fixed, or an unknown type

    def _reference(self, name: str, namespace: str) -> Writer:
        full = name if "." in name or not namespace else f"{namespace}.{name}"
        for candidate in (full, name):
            if candidate in self._named:
                return self._named[candidate]
        raise _Unsupported  # defined further on: fastavro's

    def _define(self, schema: dict[str, Any], namespace: str, writer: Writer) -> str:
        name = schema["name"]
        if name in _RESERVED_NAMES:
            raise _Unsupported
        space = schema.get("namespace", namespace)
        full = name if "." in name or not space else f"{space}.{name}"
        self._named[full] = writer
        return full.rpartition(".")[0]

    def _record(self, schema: dict[str, Any], namespace: str) -> Writer:
        fields: list[tuple[str, Writer]] = []
        # An absent field's value: its default, else null (fastavro's `default` is None).
        defaults = {f["name"]: f.get("default") for f in schema["fields"] if _has_default(f)}
        position = {f["name"]: index for index, f in enumerate(schema["fields"])}

        def write_record(out: bytearray, value: Any) -> None:
            # "-type" names the record a value is meant for: fastavro checks it.
            if type(value) is not dict or "-type" in value:
                raise NotHandled
            try:
                for name, write in fields:
                    write(out, value[name])
            except KeyError as absent:  # an absent field: the rest with defaults
                first = position.get(absent.args[0]) if absent.args else None
                if first is None:  # not `value[name]`'s: no writer raises one
                    raise NotHandled from None
                write_from(out, value, first)

        def write_from(out: bytearray, value: dict[str, Any], first: int) -> None:
            """The fields from `first` on, the absent ones with their defaults."""
            for name, write in fields[first:]:
                if name in value:
                    write(out, value[name])
                elif name in defaults:  # a default this path cannot write raises NotHandled
                    write(out, defaults[name])
                else:
                    raise NotHandled  # fastavro's error: no value and no default

        space = self._define(schema, namespace, write_record)
        fields.extend((f["name"], self.writer(f["type"], space)) for f in schema["fields"])
        return write_record

    def _enum(self, schema: dict[str, Any], namespace: str) -> Writer:
        indexes: dict[str, bytes] = {}
        for index, symbol in enumerate(schema["symbols"]):
            encoded = bytearray()
            _write_count(encoded, index)
            indexes[symbol] = bytes(encoded)

        def write_enum(out: bytearray, value: Any) -> None:
            encoded = indexes.get(value) if type(value) is str else None
            if encoded is None:
                raise NotHandled
            out += encoded

        self._define(schema, namespace, write_enum)
        return write_enum

    def _union(self, branches: list[Any], namespace: str) -> Writer:
        if len(branches) != 2 or "null" not in branches:
            raise _Unsupported
        null_index = branches.index("null")
        other = self.writer(branches[1 - null_index], namespace)
        null_tag, other_tag = (0, 2) if null_index == 0 else (2, 0)  # zigzagged 0 and 1

        def write_optional(out: bytearray, value: Any) -> None:
            if value is None:
                out.append(null_tag)
            else:
                out.append(other_tag)
                other(out, value)

        return write_optional

    @staticmethod
    def _array(item: Writer) -> Writer:
        def write_array(out: bytearray, value: Any) -> None:
            if type(value) is not list:
                raise NotHandled
            if value:
                _write_count(out, len(value))
                for element in value:
                    item(out, element)
            out.append(0)

        return write_array

    def _map(self, entry: Writer) -> Writer:
        write_key = self._strings.write

        def write_map(out: bytearray, value: Any) -> None:
            if type(value) is not dict:
                raise NotHandled
            if value:
                _write_count(out, len(value))
                for key, element in value.items():
                    write_key(out, key)
                    entry(out, element)
            out.append(0)

        return write_map
