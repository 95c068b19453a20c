"""Declarative checks of decoded events, beyond what Avro types guarantee.

`EventRules` is compiled once from a pipeline's `input.validate` and the input schema:
a rule that names no field of the schema, or does not fit the field's type (`min` on a
string), is refused at start. At run time `check(event)` raises InvalidEventError
naming the field and the rule, so the dead letter says which rule failed.

Beside the configured rules, a numeric field that a model takes as float32 must fit in
float32 (rule `float32`): 1e308 is a valid Avro double, but as float32 it is infinity,
and a model's answer to infinity is NaN. Such an event is dead-lettered, not scored.
NaN passes the rule: like null, the model's input treats it as missing (the default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from schemas.config import FieldRules
from schemas.errors import DecodeError, SchemaFileError

Check = Callable[[Any], bool]


class InvalidEventError(DecodeError):
    """A well-formed record whose values break a validation rule."""

    def __init__(self, field: str, rule: str, expected: str, got: Any) -> None:
        super().__init__(
            "invalid_field", f"field {field!r} breaks rule {rule}: expected {expected}, got {got!r}"
        )
        self.field = field
        self.rule = rule


_NUMERIC = {"int", "long", "float", "double"}
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
_SIZED = {"string", "bytes", "array", "map"}


def field_types(schema: Mapping[str, Any]) -> dict[str, set[str]]:
    """Each top-level field of a record schema with its Avro type names (a union's
    branches, named types by their kind)."""
    out = {}
    for field in schema["fields"]:
        declared = field["type"]
        branches = declared if isinstance(declared, list) else [declared]
        out[field["name"]] = {b["type"] if isinstance(b, dict) else b for b in branches}
    return out


class EventRules:
    """The compiled rules of one input schema; `check` is on the hot path."""

    def __init__(
        self,
        rules: Mapping[str, FieldRules],
        schema: Mapping[str, Any],
        float32_fields: Iterable[str] = (),
    ) -> None:
        """`float32_fields`: the fields a model takes as float32 (`float32` rule)."""
        types = field_types(schema)
        self._checks: list[tuple[str, str, str, Check]] = []
        problems = []
        for field, spec in rules.items():
            if field not in types:
                problems.append(f"validate names {field!r}, not a field of {schema['name']}")
                continue
            for rule, expected, check, fits in _rules_of(spec):
                if not fits(types[field]):
                    problems.append(
                        f"validate.{field}.{rule} does not fit field {field!r} of type "
                        f"{sorted(types[field])}"
                    )
                self._checks.append((field, rule, expected, check))
        for field in dict.fromkeys(float32_fields):
            if _numeric(types.get(field, set())):
                self._checks.append((field, "float32", _FITS_FLOAT32, _fits_float32))
        if problems:
            raise SchemaFileError(
                "; ".join(problems) + f" (fields of {schema['name']}: {list(types)})"
            )

    def check(self, event: Mapping[str, Any]) -> None:
        """Raise InvalidEventError naming the first field and rule that fail. A value the
        rule cannot compare fails it: a union field may hold a string where `min` wants
        a number."""
        for field, rule, expected, passes in self._checks:
            value = event.get(field)
            try:
                passed = passes(value)
            except (TypeError, ValueError, OverflowError):
                passed = False
            if not passed:
                raise InvalidEventError(field, rule, expected, value)

    def describe(self) -> list[str]:
        return [f"{field}: {rule} ({expected})" for field, rule, expected, _ in self._checks]


_FITS_FLOAT32 = f"a number float32 holds (|x| <= {FLOAT32_MAX:.4g})"


def _fits_float32(value: Any) -> bool:
    return value is None or not abs(value) > FLOAT32_MAX  # NaN passes: a missing value


def _any(_types: set[str]) -> bool:
    return True


def _numeric(types: set[str]) -> bool:
    return bool(types & _NUMERIC)


def _sized(types: set[str]) -> bool:
    return bool(types & _SIZED)


def _rules_of(spec: FieldRules) -> list[tuple[str, str, Check, Callable[[set[str]], bool]]]:
    """(rule, what it expects, check, whether it fits a field's types); None passes every
    rule but `required`, so an optional field is checked only when present."""
    rules: list[tuple[str, str, Check, Callable[[set[str]], bool]]] = []
    if spec.required:
        rules.append(("required", "a value", lambda v: v is not None, _any))
    if spec.non_empty:
        rules.append(("non_empty", "a non-empty value", lambda v: v is None or len(v) > 0, _sized))
    if spec.finite:
        rules.append(
            ("finite", "a finite number", lambda v: v is None or math.isfinite(v), _numeric)
        )
    low, high = spec.min, spec.max
    if low is not None:
        # NaN compares false: `min` alone also refuses NaN.
        rules.append(("min", f">= {low}", lambda v: v is None or v >= low, _numeric))
    if high is not None:
        rules.append(("max", f"<= {high}", lambda v: v is None or v <= high, _numeric))
    if spec.one_of is not None:
        allowed = frozenset(spec.one_of)
        rules.append(
            ("one_of", f"one of {sorted(allowed, key=str)}", lambda v: v is None or v in allowed,
             _any)
        )  # fmt: skip
    return rules
