"""A local Prometheus server (Debian's `prometheus` package), bound to loopback.

    server = PrometheusServer(Path(".headrace/monitor"), 9090)
    server.start(config_file)   # waits until it answers /-/ready
    ...
    server.stop()

Its time-series database lives in the state folder; the config (scrape targets, rule
files) is the caller's. Started with `--web.enable-lifecycle`, so `reload()` makes it
read a changed config without a restart.
"""

from __future__ import annotations

import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError
from infra.process import LocalService


@dataclass
class PrometheusServer(LocalService):
    service = "prometheus"
    state_dir: Path
    port: int = 9090

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/-/ready"

    def start(self, config_file: Path, timeout_s: float = 60.0) -> float:
        """Start on `config_file` unless running; returns the seconds it took (0 if it
        runs). Raises AlreadyRunning if it runs on another port."""
        if self.running_on({"port": self.port}):
            return 0.0
        binary = shutil.which("prometheus")
        if binary is None:
            raise InfraError(
                "prometheus is not installed; hint: apt-get install prometheus (./run installs it)"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        command = [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.state_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
        ]
        return self.process.launch(command, self.ready, timeout_s, ports={"port": self.port})

    def reload(self, timeout_s: float = 10.0) -> None:
        """Make the running server read its config and rule files again."""
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                pass
        except OSError as exc:
            raise InfraError(f"prometheus at {self.url} did not reload its config: {exc}") from exc
