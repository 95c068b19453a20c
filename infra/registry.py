"""A local Apicurio Registry 3, whose Confluent-compatible API is served under
`/apis/ccompat/v7`. The Quarkus app comes from Maven Central
(`io.apicurio:apicurio-registry-app`, the `tar.gz` with classifier `all`) and needs Java 21+.

Its schemas are kept on disk (H2 in file mode, in `state_dir`), not in memory: ids must
survive a restart. An in-memory registry hands out the same ids again after one, to
other schemas, and every record already framed with the old ids then decodes wrongly.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path

from infra.java import cache_dir, find_java, maven
from infra.process import LocalService

APICURIO_VERSION = "3.3.3"
CCOMPAT_PATH = "/apis/ccompat/v7"


def apicurio_app() -> Path:
    """The unpacked Quarkus app folder, fetched and unpacked on first use."""
    app = cache_dir() / f"apicurio-registry-{APICURIO_VERSION}"
    if not (app / ".complete").exists():
        archive_dir = cache_dir() / "downloads"
        maven(
            "dependency:copy",
            f"-Dartifact=io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all",
            f"-DoutputDirectory={archive_dir}",
        )
        archive = archive_dir / f"apicurio-registry-app-{APICURIO_VERSION}-all.tar.gz"
        with tarfile.open(archive) as tar:
            tar.extractall(app, filter="data")
        (app / ".complete").touch()
    return app


@dataclass
class SchemaRegistryServer(LocalService):
    service = "registry"
    state_dir: Path
    port: int = 8081
    management_port: int = 8091
    heap_mb: int = 384

    @property
    def url(self) -> str:
        """The Confluent-compatible base URL, as serializers and `registry.url` want it."""
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/subjects"

    def start(self, timeout_s: float = 120.0) -> float:
        if self.running():
            return 0.0
        java = find_java(21)
        app = apicurio_app()
        command = [
            java,
            f"-Xmx{self.heap_mb}m",
            "-Djava.awt.headless=true",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dquarkus.http.port={self.port}",
            # The management interface is fixed on at build time; keep it on loopback.
            "-Dquarkus.management.host=127.0.0.1",
            f"-Dquarkus.management.port={self.management_port}",
            "-Dquarkus.log.level=WARN",
            f"-Dapicurio.datasource.url=jdbc:h2:file:{(self.state_dir / 'schemas').resolve()}",
            # Its default pool of 20 to 100 connections is for a shared server.
            "-Dapicurio.datasource.jdbc.initial-size=2",
            "-Dapicurio.datasource.jdbc.min-size=2",
            "-Dapicurio.datasource.jdbc.max-size=8",
            "-jar",
            str(app / "quarkus-run.jar"),
        ]
        ports = {"port": self.port, "management_port": self.management_port}
        return self.process.launch(command, self.ready, timeout_s, cwd=app, ports=ports)
