"""Creating and deleting topics with explicit partition counts (confluent-kafka AdminClient).

Each call first checks that the broker answers (`list_topics`: BrokerUnavailable within
`timeout_s` when it does not), then waits at most `timeout_s` for each operation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from infra.errors import InfraError
from infra.kafka_clients import DEFAULT_TIMEOUT_S, client_settings, list_topics, unavailable

# Creating or deleting topics can take the broker longer than answering metadata.
_OPERATION_TIMEOUT_S = 30.0


def _admin(bootstrap_servers: str, timeout_s: float) -> AdminClient:
    return AdminClient(client_settings(bootstrap_servers, "admin", timeout_s))


def _done(future, bootstrap_servers: str, what: str, ignored: int | None = None) -> bool:
    """Whether an admin operation did `what` (False: it failed with the `ignored` code)."""
    try:
        future.result()
        return True
    except KafkaException as exc:
        error = exc.args[0]
        if error.code() == ignored:
            return False
        if error.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT):
            raise unavailable(bootstrap_servers, f"failed to {what}: {error.str()}") from exc
        raise InfraError(f"could not {what}: {error.str()}") from exc


def ensure_topics(
    bootstrap_servers: str,
    partitions: Mapping[str, int],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    config: Mapping[str, str] | None = None,
) -> list[str]:
    """Create the topics that do not exist yet (with `config`, e.g. compaction); return
    the names created.

    An existing topic is left as it is, whatever its partition count.
    """
    existing = list_topics(bootstrap_servers, timeout_s)
    wanted = [
        NewTopic(name, num_partitions=count, replication_factor=1, config=dict(config or {}))
        for name, count in partitions.items()
        if name not in existing
    ]
    if not wanted:
        return []
    admin = _admin(bootstrap_servers, timeout_s)
    futures = admin.create_topics(
        wanted, operation_timeout=_OPERATION_TIMEOUT_S, request_timeout=_OPERATION_TIMEOUT_S + 5
    )
    exists = KafkaError.TOPIC_ALREADY_EXISTS
    created = [
        name
        for name, future in futures.items()
        if _done(future, bootstrap_servers, f"create topic {name!r}", exists)
    ]
    admin.poll(0)  # serves its log lines
    return created


def delete_topics(
    bootstrap_servers: str, names: Iterable[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    admin = _admin(bootstrap_servers, timeout_s)
    futures = admin.delete_topics(
        list(names),
        operation_timeout=_OPERATION_TIMEOUT_S,
        request_timeout=_OPERATION_TIMEOUT_S + 5,
    )
    for name, future in futures.items():
        _done(future, bootstrap_servers, f"delete topic {name!r}", KafkaError.UNKNOWN_TOPIC_OR_PART)
    admin.poll(0)


def set_topic_config(
    bootstrap_servers: str,
    topic: str,
    settings: Mapping[str, str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Set some of a topic's configs (e.g. `message.timestamp.type`), leaving the others."""
    admin = _admin(bootstrap_servers, timeout_s)
    entries = [
        ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)
        for key, value in settings.items()
    ]
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=entries)
    futures = admin.incremental_alter_configs([resource], request_timeout=_OPERATION_TIMEOUT_S)
    for future in futures.values():
        _done(future, bootstrap_servers, f"configure topic {topic!r}")
    admin.poll(0)
