"""Errors of the stream app: configuration and publishing."""

from schemas.errors import HeadraceError


class ConfigError(HeadraceError):
    """A configuration file that cannot be used; the message names file and field."""


class PublishError(HeadraceError):
    """Kafka cannot take a batch's outcome records now (a broker away, a topic gone), or
    not even the smallest dead letter of one of them."""
