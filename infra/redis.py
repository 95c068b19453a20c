"""A local Redis server (Debian's `redis-server`) for Feast's Redis online store.

In-memory only (no snapshots, no append-only file), bound to loopback.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError
from infra.process import LocalService


@dataclass
class RedisServer(LocalService):
    service = "redis"
    state_dir: Path
    port: int = 6379

    @property
    def connection_string(self) -> str:
        """As Feast's `online_store.connection_string` wants it."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> float:
        if self.running():
            return 0.0
        binary = shutil.which("redis-server")
        if binary is None:
            raise InfraError(
                "redis-server is not installed; hint: apt-get install redis-server "
                "(./run installs it)"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        command = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.state_dir),
        ]  # fmt: skip
        return self.process.launch(command, self.ready, timeout_s, ports={"port": self.port})

    def ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.RedisError:
            return False
