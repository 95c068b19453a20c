"""A long-running local service process: detached start, readiness wait, clean stop.

The process gets its own session so that `headrace broker start` can return while
the broker runs on; its pid is kept in the service's state folder, so a later
`stop` (from another process) finds it. Beside the pid the file keeps the process's
start time (field 22 of /proc/PID/stat), because a pid outlives its process: after a
reboot or a crash the same number may name an unrelated process, which must be
neither taken for the service (a `start` that starts nothing) nor signalled. A second
line keeps the ports it was started on, so a `start` asking for other ports is refused
(AlreadyRunning) instead of reporting the service ready where it does not listen.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar

from infra.errors import InfraError

PROC = Path("/proc")


class AlreadyRunning(InfraError):
    """`start` asked for other ports than those the running service was started on."""

    exit_status = 2  # as for a port another process holds: fix the command, or stop it

    def __init__(
        self,
        name: str,
        pid: int,
        running: Mapping[str, int],
        asked: Mapping[str, int],
        stop_hint: str = "stop it first",
    ) -> None:
        self.name, self.pid, self.running, self.asked = name, pid, dict(running), dict(asked)
        super().__init__(
            f"{name} already runs (pid {pid}) with {_options(running)}, not "
            f"{_options(asked)}; hint: {stop_hint}, or start it with {_options(running)}"
        )


class NotStopped(InfraError):
    """A service that `stop` could not end: it is still running."""

    exit_status = 75  # EX_TEMPFAIL: as `produce` and `deploy --wait`, it may work on a later try


def _options(ports: Mapping[str, int]) -> str:
    return " ".join(f"--{option.replace('_', '-')} {port}" for option, port in ports.items())


class ServiceProcess:
    def __init__(self, name: str, state_dir: Path, kill_timeout_s: float = 10.0) -> None:
        self.name = name
        self.state_dir = state_dir
        self.pid_file = state_dir / f"{name}.pid"
        self.log_file = state_dir / f"{name}.log"
        self.kill_timeout_s = kill_timeout_s

    def pid(self) -> int | None:
        """The pid of the running service, or None. A pid file whose process is gone, or
        is another process now (its start time differs), is stale: it is removed, and
        nothing is signalled."""
        try:
            recorded, *identity = self.pid_file.read_text().partition("\n")[0].split()
            pid = int(recorded)
        except (OSError, ValueError):
            return None
        if _alive(pid) and self._ours(pid, identity[0] if identity else None):
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def ports(self) -> dict[str, int] | None:
        """The ports the running service was started on, by option name; None if it does
        not run, or if its pid file does not say (written by an older headrace)."""
        return None if self.pid() is None else self._recorded_ports()

    def _recorded_ports(self) -> dict[str, int] | None:
        """The pid file's second line, without asking whether its process runs."""
        try:
            _first, _, recorded = self.pid_file.read_text().partition("\n")
            pairs = [field.split("=", 1) for field in recorded.split()]
            return {option: int(port) for option, port in pairs} or None
        except (OSError, ValueError):
            return None

    def running_on(self, ports: Mapping[str, int]) -> bool:
        """Whether the service runs, on `ports` (those it was started on, by option name).
        Raises AlreadyRunning if it runs on other ones: a `start` then must not report it
        ready on the ports asked. A service whose ports were not recorded counts as on them."""
        pid = self.pid()
        if pid is None:
            return False
        running = self._recorded_ports()
        if running is not None and ports:
            differing = {option: port for option, port in ports.items()
                         if option in running and running[option] != port}  # fmt: skip
            if differing:
                raise AlreadyRunning(self.name, pid, running, differing)
        return True

    def _ours(self, pid: int, start_ticks: str | None) -> bool:
        if not (PROC / "self" / "stat").exists():
            return True  # no /proc (not Linux): the pid is all there is to go on
        if start_ticks is not None:
            return _start_ticks(pid) == start_ticks
        # A pid file written before the start time was kept: ours if it writes to our log.
        try:
            return os.readlink(PROC / str(pid) / "fd" / "1") == str(self.log_file.resolve())
        except OSError:
            return False

    def launch(
        self,
        command: list[str],
        ready: Callable[[], bool],
        timeout_s: float,
        cwd: Path | None = None,
        ports: Mapping[str, int] | None = None,
    ) -> float:
        """Start `command` unless running, wait until `ready()`; return seconds it took.

        `ports` are the loopback ports the service will listen on, by the name of the
        option that sets each: one another process listens on fails here, before
        anything starts (else `ready()` could be answered by that process). Raises
        InfraError if the process exits before it is ready (with its log's tail) or is
        not ready within `timeout_s` (then it is stopped)."""
        if self.running_on(ports or {}):
            return 0.0
        for option, port in (ports or {}).items():
            _check_free(self.name, port, option)
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
        start_ticks = _start_ticks(process.pid)
        identity = f"{process.pid} {start_ticks or ''}".rstrip()
        recorded = " ".join(f"{option}={port}" for option, port in (ports or {}).items())
        self.pid_file.write_text(f"{identity}\n{recorded}\n" if recorded else f"{identity}\n")
        deadline = started + timeout_s
        while True:
            # Asked again after `ready()`: a child that died meanwhile (on its bind, say)
            # did not answer it; whatever did is not ours.
            if process.poll() is None and ready() and process.poll() is None:
                return time.monotonic() - started
            if process.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise InfraError(
                    f"{self.name} exited with {process.returncode} while starting; "
                    f"log {self.log_file}:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        self.stop()
        raise InfraError(
            f"{self.name} was not ready within {timeout_s:.0f} s; log {self.log_file}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM, then SIGKILL after `timeout_s`. Returns whether it was running. Safe twice.

        Blocks at most `timeout_s` plus `kill_timeout_s`; raises NotStopped naming the pid
        (and keeps the pid file, which is right while the process lives) if the process
        outlives SIGKILL that long, or may not be signalled (another user's)."""
        pid = self.pid()
        if pid is None:
            return False
        start_ticks = _start_ticks(pid)
        self._signal(pid, signal.SIGTERM)
        if not _wait_gone(pid, start_ticks, timeout_s):
            self._signal(pid, signal.SIGKILL)
            if not _wait_gone(pid, start_ticks, self.kill_timeout_s):
                # The pid file stays: it still names the process, and goes by itself
                # once the process has ended (a later `pid()` finds it stale).
                raise NotStopped(
                    f"{self.name} (pid {pid}) is still running {self.kill_timeout_s:g} s "
                    f"after SIGKILL; hint: `ps -o pid,stat,cmd -p {pid}`: in state D "
                    "(uninterruptible I/O) it ends when its I/O does; then stop it again"
                )
        self.pid_file.unlink(missing_ok=True)
        return True

    def _signal(self, pid: int, sig: int) -> None:
        try:
            _signal(pid, sig)
        except PermissionError as exc:
            raise NotStopped(
                f"{self.name} (pid {pid}) may not be signalled by this user ({exc.strerror}); "
                f"hint: it was started by another user: stop it as that user (sudo), with "
                f"the same --state-dir"
            ) from exc

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

    def running_on(self, ports: Mapping[str, int]) -> bool:
        """As ServiceProcess.running_on: AlreadyRunning if it runs on other ports."""
        return self.process.running_on(ports)

    def stop(self) -> bool:
        return self.process.stop()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from field 3 (state) on, or None if unreadable."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Field 2, the command name, is in parentheses and may hold spaces and parentheses.
    return text[text.rfind(")") + 2 :].split()


def _start_ticks(pid: int) -> str | None:
    """When `pid` started, in clock ticks after boot (field 22): with the pid, an identity."""
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


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
    # Nor a zombie whose parent (not us) has not reaped it yet.
    fields = _stat(pid)
    return not (fields and fields[0] == "Z")


def _wait_gone(pid: int, start_ticks: str | None, timeout_s: float) -> bool:
    """Wait until `pid` has exited (or is another process); whether it did in `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and _start_ticks(pid) == start_ticks:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _signal(pid: int, sig: int) -> None:
    """Signal the process group `pid` leads (the service and its children), or `pid`
    alone when it leads none (it left the session it was started in). Raises
    PermissionError where this user may not signal them."""
    try:
        os.killpg(pid, sig)
        return
    except ProcessLookupError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _check_free(name: str, port: int, option: str) -> None:
    """Raise InfraError if another process listens on loopback `port` (a listener on the
    wildcard address counts: the kernel refuses 127.0.0.1 beside it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the services do: a connection in TIME_WAIT (our last run's) is no obstacle,
        # a listening socket is.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise InfraError(f"{name}: cannot bind 127.0.0.1:{port}: {exc.strerror}") from exc
            raise InfraError(
                f"{name}: port {port} is taken (by another process); "
                f"hint: stop it or pass --{option.replace('_', '-')}"
            ) from None
