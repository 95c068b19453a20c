"""A local Jaeger (v2) server, an OTLP backend for `tracing: {exporter: otlp}`: OTLP over
HTTP in, Jaeger's query API out, in-memory storage, everything on loopback.

Jaeger ships no jar and no PyPI package: its binary is built from the Go module proxy
(about 1.3 GB of modules and eight minutes of build on two cores, too much for the test
command), so this starts a binary built beforehand, named by `HEADRACE_JAEGER` or found
as `jaeger` on PATH:

    mkdir jaeger-build && cd jaeger-build && go mod init jaeger-build
    go get -tool github.com/jaegertracing/jaeger/cmd/jaeger@v1.76.0
    go build -o jaeger github.com/jaegertracing/jaeger/cmd/jaeger
    export HEADRACE_JAEGER=$PWD/jaeger

    jaeger = JaegerServer(Path(".headrace/jaeger"), otlp_port=4318, query_port=16686,
                          health_port=13133)
    jaeger.start()   # waits until its health check answers
    ...
    jaeger.stop()
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.process import LocalService

# Jaeger v2 is an OpenTelemetry Collector: one OTLP/HTTP receiver, a memory store, the
# query API on its own port, and no telemetry listener of its own.
_CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health_port}
  jaeger_query:
    storage:
      traces: memory
    http:
      endpoint: 127.0.0.1:{query_port}
    grpc:
      endpoint: 127.0.0.1:{query_grpc_port}
  jaeger_storage:
    backends:
      memory:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp_port}
processors:
  batch:
    timeout: 200ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memory
"""


def jaeger_binary() -> Path | None:
    """The Jaeger binary named by `HEADRACE_JAEGER`, else `jaeger` on PATH; None if neither."""
    named = os.environ.get("HEADRACE_JAEGER")
    if named:
        return Path(named) if Path(named).is_file() else None
    found = shutil.which("jaeger")
    return Path(found) if found else None


@dataclass
class JaegerServer(LocalService):
    service = "jaeger"
    state_dir: Path
    otlp_port: int
    query_port: int
    health_port: int
    query_grpc_port: int = 0  # 0: the query port plus one

    @property
    def spans_endpoint(self) -> str:
        """Where OTLP/HTTP exporters send spans (`tracing.endpoint`)."""
        return f"http://127.0.0.1:{self.otlp_port}/v1/traces"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}/status"

    def start(self, timeout_s: float = 60.0) -> float:
        if self.running():
            return 0.0
        binary = jaeger_binary()
        if binary is None:
            raise FileNotFoundError("no Jaeger binary: set HEADRACE_JAEGER (see infra/jaeger.py)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "jaeger.yaml"
        config.write_text(_CONFIG.format(
            otlp_port=self.otlp_port, query_port=self.query_port, health_port=self.health_port,
            query_grpc_port=self.query_grpc_port or self.query_port + 1,
        ))  # fmt: skip
        command = [str(binary), "--config", f"file:{config}"]
        ports = {
            "otlp_port": self.otlp_port,
            "query_port": self.query_port,
            "health_port": self.health_port,
            "query_grpc_port": self.query_grpc_port or self.query_port + 1,
        }
        return self.process.launch(command, self.ready, timeout_s, ports=ports)

    def trace(self, trace_id: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """The spans Jaeger holds of one trace, each with its process's `serviceName`
        (none: an empty list)."""
        url = f"http://127.0.0.1:{self.query_port}/api/traces/{trace_id}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                found = json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise
        spans = []
        for trace in found.get("data") or []:
            processes = trace["processes"]
            for span in trace["spans"]:
                spans.append({**span, "serviceName": processes[span["processID"]]["serviceName"]})
        return spans
