"""Errors of the stream app: configuration and publishing."""

from schemas.errors import HeadraceError


class ConfigError(HeadraceError):
    """A configuration file that cannot be used; the message names file and field."""


class PublishError(HeadraceError):
    """Kafka cannot take a batch's outcome records now (a broker away, a topic gone), or
    not even the smallest dead letter of one of them."""


class TransactionFenced(HeadraceError):
    """The worker's transactional producer was fenced (a newer one with its id took
    over) or hit another fatal error: it can never commit again, the worker must end."""


class TransactionFailed(HeadraceError):
    """A transaction Kafka would not take for ~15 s of retries (exactly-once): the worker
    must end without committing it."""
