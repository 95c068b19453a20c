"""A long-running local service process: detached start, readiness wait, clean stop.

The process gets its own session so that `headrace broker start` can return while
the broker runs on; its pid is kept in the service's state folder, so a later
`stop` (from another process) finds it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from infra.errors import InfraError


class ServiceProcess:
    def __init__(self, name: str, state_dir: Path) -> None:
        self.name = name
        self.state_dir = state_dir
        self.pid_file = state_dir / f"{name}.pid"
        self.log_file = state_dir / f"{name}.log"

    def pid(self) -> int | None:
        """The pid of the running service, or None (a stale pid file is removed)."""
        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None
        if _alive(pid):
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def launch(
        self,
        command: list[str],
        ready: Callable[[], bool],
        timeout_s: float,
        cwd: Path | None = None,
    ) -> float:
        """Start `command` unless running, wait until `ready()`; return seconds it took."""
        if self.pid() is not None:
            return 0.0
        self.state_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_file, "ab") as log:
            process = subprocess.Popen(
                command,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid_file.write_text(str(process.pid))
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise InfraError(
                    f"{self.name} exited with {process.returncode} while starting; "
                    f"log {self.log_file}:\n{self.log_tail()}"
                )
            if ready():
                return time.monotonic() - started
            time.sleep(0.2)
        self.stop()
        raise InfraError(
            f"{self.name} was not ready within {timeout_s:.0f} s; log {self.log_file}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM, then SIGKILL after `timeout_s`. Returns whether it was running. Safe twice."""
        pid = self.pid()
        if pid is None:
            return False
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            _signal_group(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return True

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalService:
    """What the local services share: a process named `service` in `state_dir`, a
    stop, and readiness as an HTTP GET of `health_url` answering 200 (a service whose
    readiness is not HTTP overrides `ready`). Subclasses are dataclasses with a
    `state_dir` field."""

    service: ClassVar[str]
    state_dir: Path

    @property
    def health_url(self) -> str:
        raise NotImplementedError

    @property
    def process(self) -> ServiceProcess:
        return ServiceProcess(self.service, self.state_dir)

    def running(self) -> bool:
        return self.process.pid() is not None

    def stop(self) -> bool:
        return self.process.stop()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False


def _alive(pid: int) -> bool:
    # Reap it if it is our own child, so a zombie does not count as alive.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
