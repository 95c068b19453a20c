"""Errors of the wire format and schema resolution.

`schemas/` is the bottom layer of headrace, so the project's base error lives here
and the other packages derive theirs from it.
"""


class HeadraceError(Exception):
    """Base of every error headrace raises on purpose."""


class DecodeError(HeadraceError):
    """A record that cannot be turned into an event.

    `reason` is a short stable code (it goes into dead-letter headers and metrics);
    the message says what was expected, what arrived, and a hint.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SchemaNotFoundError(DecodeError):
    """A schema id that neither the registry nor the local catalogue knows."""

    def __init__(self, schema_id: int, where: str) -> None:
        super().__init__(
            "unknown_schema",
            f"schema id {schema_id} is not known to {where}; "
            "hint: register the schema, or point the worker at the producer's registry",
        )
        self.schema_id = schema_id


class RegistryError(HeadraceError):
    """The schema registry could not be reached or answered with an error."""


class RegistryUnavailable(RegistryError):
    """The schema registry did not answer (down, unreachable, or past its timeout)."""

    exit_status = 69  # EX_UNAVAILABLE: worth retrying once the registry is back


class SchemaFileError(HeadraceError):
    """A schema file that cannot be read or is not a valid Avro record schema."""
