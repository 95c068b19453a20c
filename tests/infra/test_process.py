"""The local service process: a pid file is trusted only while it names our process,
stop is bounded, and start refuses a port another process listens on. Stand-in
processes (`sleep`, a Python one-liner, an in-process HTTP server), no real services."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from infra import process as process_module
from infra.errors import InfraError
from infra.ports import free_port
from infra.process import AlreadyRunning, NotStopped, ServiceProcess
from tests.helpers import headrace


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def gone_or_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"


@pytest.fixture
def unrelated() -> Iterator[subprocess.Popen]:
    """A process that is no service of ours and leads no process group (as a pid reused
    after a reboot would be)."""
    sleeper = subprocess.Popen(["sleep", "300"])
    yield sleeper
    sleeper.kill()
    sleeper.wait()


@pytest.fixture
def service(tmp_path) -> Iterator[ServiceProcess]:
    service = ServiceProcess("standin", tmp_path / "state", kill_timeout_s=5.0)
    yield service
    service.stop(timeout_s=5.0)


@pytest.fixture
def foreign_http() -> Iterator[Callable[[str], int]]:
    """Start an HTTP server answering 200 to everything on `host` (another process's
    service, as far as ours can tell); returns its port."""
    servers = []

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    def start(host: str) -> int:
        server = http.server.ThreadingHTTPServer((host, 0), Ok)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def answers(port: int, path: str = "/") -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# 1. A stale pid file.


@pytest.mark.timeout(30)
@pytest.mark.parametrize("recorded", ["pid", "pid and another start time"])
def test_a_pid_file_naming_another_process_is_removed_not_signalled(service, unrelated, recorded):
    service.state_dir.mkdir(parents=True)
    text = str(unrelated.pid) if recorded == "pid" else f"{unrelated.pid} 1"
    service.pid_file.write_text(text)
    assert service.pid() is None
    assert not service.pid_file.exists()
    service.pid_file.write_text(text)
    assert service.stop() is False
    assert not service.pid_file.exists()
    assert unrelated.poll() is None


@pytest.mark.timeout(30)
def test_start_over_a_stale_pid_file_starts_the_service(service, unrelated):
    service.state_dir.mkdir(parents=True)
    service.pid_file.write_text(str(unrelated.pid))
    service.launch(["sleep", "300"], lambda: True, timeout_s=10)
    pid = service.pid()
    assert pid is not None
    assert pid != unrelated.pid
    assert service.stop(timeout_s=5.0) is True
    assert wait_for(lambda: gone_or_zombie(pid))
    assert unrelated.poll() is None


@pytest.mark.timeout(30)
def test_a_pid_file_of_an_older_headrace_is_still_ours(service):
    # Written before the start time was kept: ours because it writes to our log.
    service.state_dir.mkdir(parents=True)
    with open(service.log_file, "ab") as log:
        ours = subprocess.Popen(["sleep", "300"], stdout=log)
    try:
        service.pid_file.write_text(str(ours.pid))
        assert service.pid() == ours.pid
        # It leads no process group (killpg finds none): stop signals the pid itself.
        assert service.stop(timeout_s=5.0) is True
        assert ours.poll() is not None
        assert not service.pid_file.exists()
    finally:
        ours.kill()
        ours.wait()


@pytest.mark.timeout(30)
def test_stop_signals_our_process_when_it_leads_no_group(service):
    service.state_dir.mkdir(parents=True)
    ours = subprocess.Popen(["sleep", "300"])
    try:
        ticks = process_module._start_ticks(ours.pid)
        service.pid_file.write_text(f"{ours.pid} {ticks}\n")
        assert service.pid() == ours.pid
        assert service.stop(timeout_s=5.0) is True
        assert ours.poll() is not None
    finally:
        ours.kill()
        ours.wait()


IGNORES_SIGTERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring', flush=True)\n"
    "time.sleep(300)\n"
)


@pytest.mark.timeout(30)
def test_stop_kills_what_ignores_sigterm(service):
    service.launch(
        [sys.executable, "-c", IGNORES_SIGTERM],
        lambda: "ignoring" in service.log_tail(),
        timeout_s=10,
    )
    pid = service.pid()
    started = time.monotonic()
    assert service.stop(timeout_s=0.5) is True
    assert time.monotonic() - started < 5
    assert gone_or_zombie(pid)


@pytest.mark.timeout(30)
def test_stop_gives_up_naming_the_pid(service, monkeypatch):
    service.kill_timeout_s = 0.3
    service.launch(["sleep", "300"], lambda: True, timeout_s=10)
    pid = service.pid()
    # A process no signal ends (uninterruptible sleep, as far as stop can tell).
    monkeypatch.setattr(process_module, "_signal", lambda pid, sig: None)
    with pytest.raises(NotStopped, match=rf"standin \(pid {pid}\) is still running") as raised:
        service.stop(timeout_s=0.3)
    assert raised.value.exit_status == 75
    assert service.pid() == pid  # kept: it is still there
    monkeypatch.undo()


# How `stop` cannot end a process: it outlives SIGKILL (uninterruptible I/O, as far as
# stop can tell), or it is another user's.


def _outlives_sigkill(monkeypatch) -> None:
    monkeypatch.setattr(process_module, "_signal", lambda pid, sig: None)
    monkeypatch.setattr(process_module, "_wait_gone", lambda pid, ticks, timeout_s: False)


def _another_users(monkeypatch) -> None:
    def refused(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(process_module.os, "killpg", refused)


UNSTOPPABLE = {
    "outlives SIGKILL": (
        _outlives_sigkill,
        "is still running 10 s after SIGKILL; hint: `ps -o pid,stat,cmd -p {pid}`",
    ),
    "another user's": (
        _another_users,
        "may not be signalled by this user (Operation not permitted); hint: it was started "
        "by another user",
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", list(UNSTOPPABLE))
def test_a_stop_that_cannot_end_the_process_names_it_and_exits_75(
    tmp_path, capsys, monkeypatch, how
):
    """An operational failure (as `produce`'s 75), not a usage error (2): the command was
    right, the process did not end; one line names it and what to do."""
    from tools.cli import main

    state = tmp_path / "monitor"
    standin = ServiceProcess("prometheus", state)
    standin.launch(["sleep", "300"], lambda: True, timeout_s=10)
    pid = standin.pid()
    patch, expected = UNSTOPPABLE[how]
    try:
        patch(monkeypatch)
        monkeypatch.setattr(sys, "argv", ["headrace", "monitor", "stop", "--state-dir", str(state)])
        with pytest.raises(SystemExit) as exited:
            main()
        monkeypatch.undo()
        out, err = capsys.readouterr()
        assert exited.value.code == 75, err
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"headrace: prometheus (pid {pid}) {expected.format(pid=pid)}")
        assert standin.pid() == pid  # still running, still recorded
    finally:
        monkeypatch.undo()
        standin.stop(timeout_s=5.0)


# 2. A port another process listens on, or the service itself on other ports.


@pytest.mark.timeout(30)
def test_start_on_other_ports_while_running_is_refused_naming_both(service):
    first, other = {"port": free_port(), "admin_port": free_port()}, free_port()
    service.launch(["sleep", "300"], lambda: True, timeout_s=10, ports=first)
    pid = service.pid()
    assert service.ports() == first
    # The same ports: it runs, nothing starts.
    assert service.launch(["false"], lambda: False, timeout_s=10, ports=first) == 0.0
    with pytest.raises(AlreadyRunning) as raised:
        service.launch(["false"], lambda: False, timeout_s=10, ports={**first, "port": other})
    assert str(raised.value) == (
        f"standin already runs (pid {pid}) with --port {first['port']} --admin-port "
        f"{first['admin_port']}, not --port {other}; hint: stop it first, or start it with "
        f"--port {first['port']} --admin-port {first['admin_port']}"
    )
    assert raised.value.exit_status == 2
    assert service.pid() == pid  # untouched


@pytest.mark.timeout(30)
def test_a_pid_file_without_ports_still_counts_as_running(service):
    # Written by a headrace that did not record ports: nothing to compare, as before.
    service.launch(["sleep", "300"], lambda: True, timeout_s=10)
    assert service.ports() is None
    assert service.running_on({"port": free_port()}) is True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_start_on_a_taken_port_fails_before_launching(service, foreign_http, host):
    port = foreign_http(host)
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with pytest.raises(InfraError) as raised:
        service.launch(command, lambda: answers(port), timeout_s=10, ports={"query_port": port})
    message = str(raised.value)
    assert "\n" not in message
    assert f"port {port} is taken (by another process)" in message
    assert "hint: stop it or pass --query-port" in message
    assert not service.pid_file.exists()
    assert not service.log_file.exists()  # nothing was started


@pytest.mark.timeout(30)
def test_a_child_that_exits_while_starting_fails_with_its_log(service):
    """However ready() answers: here it says yes only once our child has exited, as the
    other service on our port would while our child dies on its bind."""
    go = service.state_dir / "go"
    command = [
        sys.executable,
        "-c",
        "import os, sys, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "print('bind: address already in use', flush=True)\n"
        "sys.exit(1)\n",
    ]

    def ready() -> bool:
        go.touch()
        pid = int(service.pid_file.read_text().split()[0])
        return wait_for(lambda: gone_or_zombie(pid))

    with pytest.raises(InfraError, match="exited with 1 while starting") as raised:
        service.launch(command, ready, timeout_s=10)
    assert "address already in use" in str(raised.value)
    assert not service.pid_file.exists()


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus")
def test_monitor_start_on_a_taken_port_is_one_line_and_status_2(
    tmp_path, foreign_http, capsys, monkeypatch
):
    from infra.monitoring import PrometheusServer
    from tools.cli import main

    port = foreign_http("127.0.0.1")
    state = tmp_path / "monitor"
    arguments = ["monitor", "start", "--port", str(port), "--state-dir", str(state)]
    monkeypatch.setattr(sys, "argv", ["headrace", *arguments, "--target", "127.0.0.1:1"])
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        PrometheusServer(state, port).stop()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"headrace: prometheus: port {port} is taken (by another process); "
        "hint: stop it or pass --port"
    ]


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus")
def test_monitor_start_on_another_port_while_it_runs_is_refused_naming_its_port(tmp_path):
    state = tmp_path / "monitor"
    port, other = free_port(), free_port()

    def start(on: int):
        return headrace("monitor", "start", "--port", str(on), "--state-dir", str(state),
                        "--target", "127.0.0.1:1", cwd=tmp_path)  # fmt: skip

    try:
        first = start(port)
        assert first.code == 0, first.output
        pid = ServiceProcess("prometheus", state).pid()
        refused = start(other)
        assert "Traceback" not in refused.output
        assert refused.code == 2, refused.output
        assert refused.lines == [
            f"headrace: prometheus already runs (pid {pid}) with --port {port}, not --port "
            f"{other}; hint: stop it first (`headrace monitor stop --state-dir {state}`), or "
            f"start it with --port {port}"
        ]
        assert answers(port, "/-/ready")
        assert not answers(other, "/-/ready")
        again = start(port)  # the same port: it runs, its config is reloaded
        assert again.code == 0, again.output
        assert f"prometheus at http://127.0.0.1:{port} (already running" in again.output
        assert ServiceProcess("prometheus", state).pid() == pid
    finally:
        headrace("monitor", "stop", "--state-dir", str(state), cwd=tmp_path)
