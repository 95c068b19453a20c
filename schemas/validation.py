"""Semantic checks of a decoded transaction, beyond what Avro types guarantee."""

from __future__ import annotations

import math
from typing import Any

from schemas.errors import DecodeError


class InvalidEventError(DecodeError):
    """A well-formed record whose values cannot be scored."""

    def __init__(self, message: str) -> None:
        super().__init__("invalid_field", message)


def validate_transaction(event: dict[str, Any]) -> None:
    """Raise InvalidEventError naming the first field that cannot be scored."""
    for key_field in ("event_id", "user_id", "merchant_id"):
        if not event[key_field]:
            raise InvalidEventError(f"field {key_field!r} must be a non-empty string, got ''")
    amount = event["amount"]
    if not math.isfinite(amount) or amount < 0:
        raise InvalidEventError(f"field 'amount' must be finite and >= 0, got {amount!r}")
    hour = event["hour_of_day"]
    if not 0 <= hour <= 23:
        raise InvalidEventError(f"field 'hour_of_day' must be within 0..23, got {hour}")
