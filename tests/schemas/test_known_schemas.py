"""A worker restarted while the registry is down keeps what the registry told it before."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.ports import free_port
from schemas.catalogue import RegistryCatalogue
from schemas.errors import RegistryError, RegistryUnavailable

pytestmark = pytest.mark.integration

ANSWER = {"type": "record", "name": "Known", "fields": [{"name": "score", "type": "double"}]}
EVENT = {"type": "record", "name": "Seen", "fields": [{"name": "n", "type": "long"}]}


def test_ids_learned_from_the_registry_survive_its_outage(registry, tmp_path):
    known = tmp_path / "known-schemas.json"
    online = RegistryCatalogue(registry.url, 5.0, known)
    answer_id = online.id_for("known-answers-value", ANSWER)
    event_id = online.id_for("known-events-value", EVENT)
    assert online.schema_for_id(event_id) == EVENT

    down = RegistryCatalogue(f"http://127.0.0.1:{free_port()}/apis/ccompat/v7", 2.0, known)
    assert down.id_for("known-answers-value", ANSWER) == answer_id
    assert down.schema_for_id(event_id) == EVENT
    changed = {**ANSWER, "name": "Changed"}
    with pytest.raises(RegistryError):  # never met: nothing to fall back on
        down.id_for("known-answers-value", changed)
    with pytest.raises(RegistryError):
        down.schema_for_id(event_id + 1000)


def test_without_a_file_nothing_is_kept(registry, tmp_path):
    RegistryCatalogue(registry.url, 5.0, None).id_for("kept-nowhere-value", EVENT)
    down = RegistryCatalogue(f"http://127.0.0.1:{free_port()}/apis/ccompat/v7", 2.0, None)
    with pytest.raises(RegistryError):
        down.id_for("kept-nowhere-value", EVENT)


def test_a_registry_that_never_answers_fails_a_lookup_within_its_timeout(tmp_path):
    """`registry.timeout_s` bounds one call: the client's own retries would multiply it
    (the worker retries a failed lookup itself, with backoff, other partitions going on)."""
    with socket.socket() as hung:  # accepts connections (the kernel's backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/apis/ccompat/v7"
        catalogue = RegistryCatalogue(url, 1.0, tmp_path / "known-schemas.json")
        started = time.monotonic()
        with pytest.raises(RegistryError, match="unreachable"):
            catalogue.schema_for_id(12345)
        assert time.monotonic() - started < 2.5


@pytest.fixture
def answering_503() -> Iterator[str]:
    """The URL of a proxy whose registry is down: every request answered 503."""

    class Unavailable(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = _refuse

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/apis/ccompat/v7"
    finally:
        server.shutdown()
        server.server_close()


def test_a_registry_answering_503_is_down_not_refusing(registry, answering_503, tmp_path):
    """A 5xx is an outage: the id kept from before is used, and a schema never met is
    `RegistryUnavailable` (exit 69), not a refusal (exit 2)."""
    known = tmp_path / "known-schemas.json"
    answer_id = RegistryCatalogue(registry.url, 5.0, known).id_for("proxied-value", ANSWER)
    proxied = RegistryCatalogue(answering_503, 2.0, known)
    assert proxied.id_for("proxied-value", ANSWER) == answer_id
    with pytest.raises(RegistryUnavailable, match="could not be reached"):
        proxied.id_for("proxied-value", {**ANSWER, "name": "NeverMet"})
    with pytest.raises(RegistryUnavailable):
        proxied.latest("proxied-value")
    with pytest.raises(RegistryUnavailable):  # an id never met, read from the registry
        proxied.schema_for_id(answer_id + 1000)


def test_the_registry_s_answer_comes_before_the_file_s(registry, tmp_path):
    """A registry started afresh at the same address hands its ids out again: the file
    kept from before may name another schema for an id, and must not decode with it
    while the registry can answer."""
    known = tmp_path / "known-schemas.json"
    event_id = RegistryCatalogue(registry.url, 5.0, None).id_for("fresh-events-value", EVENT)
    stale = {**EVENT, "name": "FromAnOldRegistry"}
    known.write_text(json.dumps({"ids": {str(event_id): stale}, "subjects": {}}))
    assert RegistryCatalogue(registry.url, 5.0, known).schema_for_id(event_id) == EVENT
    down = RegistryCatalogue(f"http://127.0.0.1:{free_port()}/apis/ccompat/v7", 2.0, known)
    assert down.schema_for_id(event_id) == EVENT  # learned from the registry, kept
