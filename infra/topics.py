"""Creating and deleting topics with explicit partition counts (confluent-kafka AdminClient)."""

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


def ensure_topics(bootstrap_servers: str, partitions: Mapping[str, int]) -> list[str]:
    """Create the topics that do not exist yet; return the names created.

    An existing topic is left as it is, whatever its partition count.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    existing = admin.list_topics(timeout=10).topics
    wanted = [
        NewTopic(name, num_partitions=count, replication_factor=1)
        for name, count in partitions.items()
        if name not in existing
    ]
    if not wanted:
        return []
    created = []
    for name, future in admin.create_topics(wanted, operation_timeout=30).items():
        try:
            future.result()
            created.append(name)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise InfraError(f"could not create topic {name!r}: {exc}") from exc
    return created


def delete_topics(bootstrap_servers: str, names: Iterable[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    futures = admin.delete_topics(list(names), operation_timeout=30)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise InfraError(f"could not delete topic {name!r}: {exc}") from exc


def set_topic_config(bootstrap_servers: str, topic: str, settings: Mapping[str, str]) -> None:
    """Set some of a topic's configs (e.g. `message.timestamp.type`), leaving the others."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    entries = [
        ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)
        for key, value in settings.items()
    ]
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=entries)
    for future in admin.incremental_alter_configs([resource]).values():
        try:
            future.result()
        except KafkaException as exc:
            raise InfraError(f"could not configure topic {topic!r}: {exc}") from exc
