"""A local MLflow tracking server with its Model Registry: a SQLite backend and a local
artifact root in `state_dir`, artifacts served through the server (`mlflow server`,
from the `mlflow` extra)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from infra.process import LocalService


@dataclass
class MlflowServer(LocalService):
    service = "mlflow"
    state_dir: Path
    port: int = 5000

    @property
    def url(self) -> str:
        """The tracking URI, as `registry.mlflow_uri` wants it."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def start(self, timeout_s: float = 120.0) -> float:
        state = self.state_dir.resolve()
        state.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}",
            "--artifacts-destination", str(state / "artifacts"),
        ]  # fmt: skip
        ports = {"port": self.port}
        return self.process.launch(command, self.ready, timeout_s, cwd=state, ports=ports)
