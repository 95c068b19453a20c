"""A local Zipkin server, the trace backend of `tracing: {exporter: zipkin}`: the
`io.zipkin:zipkin-server` exec jar from Maven Central (Java 17+), in-memory storage,
its API and UI on loopback.

    zipkin = ZipkinServer(Path(".headrace/zipkin"), 9411)
    zipkin.start()   # fetches the jar once, waits until it answers /health
    ...
    zipkin.stop()

Spans live in memory: a restart forgets them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.java import cache_dir, find_java, maven
from infra.process import LocalService

ZIPKIN_VERSION = "3.5.1"


def zipkin_jar() -> Path:
    """The server's exec jar, copied from Maven Central on first use."""
    folder = cache_dir() / f"zipkin-{ZIPKIN_VERSION}"
    jar = folder / f"zipkin-server-{ZIPKIN_VERSION}-exec.jar"
    if not jar.exists():
        maven(
            "dependency:copy",
            f"-Dartifact=io.zipkin:zipkin-server:{ZIPKIN_VERSION}:jar:exec",
            f"-DoutputDirectory={folder}",
        )
    return jar


@dataclass
class ZipkinServer(LocalService):
    service = "zipkin"
    state_dir: Path
    port: int = 9411
    heap_mb: int = 256

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spans_endpoint(self) -> str:
        """Where exporters send spans (`tracing.endpoint`)."""
        return f"{self.url}/api/v2/spans"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def start(self, timeout_s: float = 120.0) -> float:
        if self.running():
            return 0.0
        command = [
            find_java(17),
            f"-Xmx{self.heap_mb}m",
            "-jar",
            str(zipkin_jar()),
            "--zipkin.storage.type=mem",
            # Armeria's listener: loopback only (its default is every interface).
            "--armeria.ports[0].ip=127.0.0.1",
            f"--armeria.ports[0].port={self.port}",
            "--armeria.ports[0].protocols=http",
            "--logging.level.root=WARN",
        ]
        return self.process.launch(command, self.ready, timeout_s, ports={"port": self.port})

    def trace(self, trace_id: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """The spans Zipkin holds of one trace (none: an empty list)."""
        try:
            with urllib.request.urlopen(
                f"{self.url}/api/v2/trace/{trace_id}", timeout=timeout_s
            ) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise
