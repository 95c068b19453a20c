"""Errors of the stream app: configuration and publishing."""

from schemas.errors import HeadraceError


class ConfigError(HeadraceError):
    """A configuration file that cannot be used; the message names file and field."""


class PublishError(HeadraceError):
    """Kafka did not accept an outcome record within the producer's delivery timeout."""
