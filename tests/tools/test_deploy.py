"""Waiting for a worker to say it is ready: what the demo and the restart bench do
before they send events (sent earlier, events wait in Kafka past their deadlines)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.ports import free_port
from streams.health import READY_PATH
from tools.deploy import wait_until_ready

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sleeping_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_ready_once_the_endpoint_answers_200_after_503s(sleeping_process):
    asked = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_response(200 if len(asked) > 3 else 503)
            self.end_headers()

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert wait_until_ready(sleeping_process, server.server_address[1], 30)
    finally:
        server.shutdown()
    assert asked == [READY_PATH] * 4


def test_not_ready_at_once_when_the_worker_exits():
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    assert not wait_until_ready(exited, free_port(), 30)
    assert time.monotonic() - started < 10


def test_not_ready_when_nothing_answers_in_time(sleeping_process):
    started = time.monotonic()
    assert not wait_until_ready(sleeping_process, free_port(), 1)
    assert time.monotonic() - started < 5
