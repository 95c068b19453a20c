"""A local single-node Apache Kafka 4 broker in KRaft mode, run from Maven Central jars.

    broker = KafkaBroker(Path(".headrace/kafka"))
    broker.start()   # fetches jars once, formats storage once, waits for metadata
    ...
    broker.stop()

The broker runs detached; `start()` on a running broker returns at once (or raises
AlreadyRunning where it runs on other ports), and a broker started by another process
is stopped through its pid file.
"""

from __future__ import annotations

import base64
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError
from infra.java import INFRA_DIR, cache_dir, find_java, maven
from infra.process import LocalService

KAFKA_VERSION = "4.4.0"


def kafka_jars() -> Path:
    """The broker's classpath folder, copied from Maven Central on first use."""
    lib = cache_dir() / f"kafka-{KAFKA_VERSION}"
    if not (lib / ".complete").exists():
        maven(
            "-f",
            str(INFRA_DIR / "kafka-pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={lib}",
        )
        (lib / ".complete").touch()
    return lib


def kafka_tools_jars() -> Path:
    """The folder of Kafka's command-line tools jar, copied from Maven Central on first
    use; it runs with the broker's jars on the classpath too."""
    lib = cache_dir() / f"kafka-tools-{KAFKA_VERSION}"
    if not (lib / ".complete").exists():
        maven(
            "-f",
            str(INFRA_DIR / "kafka-tools-pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={lib}",
        )
        (lib / ".complete").touch()
    return lib


@dataclass(frozen=True)
class GroupOffsets:
    """One partition's row of `kafka-consumer-groups --describe`."""

    topic: str
    partition: int
    current_offset: int | None
    log_end_offset: int
    lag: int | None


def describe_group(
    bootstrap_servers: str, group: str, timeout_s: float = 60.0
) -> list[GroupOffsets]:
    """Kafka's own consumer-groups tool (`ConsumerGroupCommand --describe`) on `group`:
    the committed offset, log-end offset and lag of each partition it has. Blocks while
    a JVM starts (a few seconds)."""
    import subprocess

    classpath = f"{kafka_tools_jars()}/*:{kafka_jars()}/*"
    command = [
        find_java(17), "-Xmx256m", "-cp", classpath,
        "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
        "--bootstrap-server", bootstrap_servers, "--describe", "--group", group,
        "--timeout", str(int(timeout_s * 1000) // 2),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise InfraError(f"kafka-consumer-groups did not answer within {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        raise InfraError(
            f"kafka-consumer-groups failed ({done.returncode}):\n{done.stderr[-2000:]}"
        )
    rows = []
    header: list[str] | None = None
    for line in done.stdout.splitlines():
        fields = line.split()
        if fields[:2] == ["GROUP", "TOPIC"]:
            header = fields
        elif header is not None and len(fields) >= 6 and fields[0] == group:
            row = dict(zip(header, fields, strict=False))

            def number(name: str, row: dict = row) -> int | None:
                return None if row[name] == "-" else int(row[name])

            rows.append(GroupOffsets(row["TOPIC"], int(row["PARTITION"]), number("CURRENT-OFFSET"),
                                     int(row["LOG-END-OFFSET"]), number("LAG")))  # fmt: skip
    return rows


@dataclass
class KafkaBroker(LocalService):
    service = "kafka"
    state_dir: Path
    port: int = 9092
    controller_port: int = 9093
    heap_mb: int = 512

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> float:
        """Start and wait until the broker answers metadata; returns the seconds it took
        (0 if it runs). Raises AlreadyRunning if it runs on other ports."""
        if self.running_on(self._ports):
            return 0.0
        java = find_java(17)
        lib = kafka_jars()
        data = self.state_dir / "data"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        properties = self.state_dir / "server.properties"
        properties.write_text(self._properties(data))
        shutil.copy(INFRA_DIR / "log4j2.yaml", self.state_dir / "log4j2.yaml")
        jvm = [
            java,
            f"-Xmx{self.heap_mb}m",
            f"-Xms{min(self.heap_mb, 256)}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.yaml'}",
            "-cp",
            f"{lib}/*",
        ]
        if not (data / "meta.properties").exists():
            self._format(jvm, properties)
        command = [*jvm, "kafka.Kafka", str(properties)]
        return self.process.launch(command, self.ready, timeout_s, ports=self._ports)

    @property
    def _ports(self) -> dict[str, int]:
        """By the option that sets each (the CLI's and the error messages' names)."""
        return {"port": self.port, "controller_port": self.controller_port}

    def ready(self) -> bool:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        try:
            return bool(admin.list_topics(timeout=1).brokers)
        except Exception:
            return False

    def _format(self, jvm: list[str], properties: Path) -> None:
        import subprocess

        # A cluster id is 16 random bytes in unpadded URL-safe base64, as `random-uuid` prints.
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        done = subprocess.run(
            # `--cluster-id=` form: an id may start with "-", which argparse takes for a flag.
            [
                *jvm,
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",
                "-c",
                str(properties),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise InfraError(f"formatting Kafka storage failed:\n{done.stdout}{done.stderr}")

    def _properties(self, data: Path) -> str:
        return "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
                f"CONTROLLER://127.0.0.1:{self.controller_port}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                "controller.listener.names=CONTROLLER",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                f"log.dirs={data}",
                # Topics are created explicitly, with their partition counts.
                "auto.create.topics.enable=false",
                "num.partitions=1",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=4",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "share.coordinator.state.topic.replication.factor=1",
                "group.initial.rebalance.delay.ms=0",
                "log.retention.hours=24",
                "",
            ]
        )
