"""Errors of the local service launchers and of the Kafka clients."""

from schemas.errors import HeadraceError


class InfraError(HeadraceError):
    """A local service could not be installed, started or stopped."""


class BrokerUnavailable(InfraError):
    """Kafka did not answer within the client's timeout, or failed a command half way."""

    exit_status = 69  # EX_UNAVAILABLE: worth retrying once the broker is back
