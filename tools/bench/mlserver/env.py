"""The MLServer baseline's own virtual environment, built on demand.

MLServer 1.7.1 and Feast 0.67 cannot be installed together by a resolver: MLServer pins
`fastapi<0.116` (so `starlette<0.47`), Feast 0.67 asks for `starlette>=1.0.1`. Feast
needs starlette only for its HTTP feature server (`feast serve`), which the baseline
does not run; its import-time use of fastapi works with MLServer's older fastapi. So
the environment is built in three steps: MLServer with its dependencies, then Feast
without its dependencies, then Feast's dependencies less the web-server ones, resolved
together with MLServer's pin so that nothing MLServer needs moves. A smoke import of
everything the runtime uses ends the build; only then is the environment marked
complete. The same Feast version as headrace's reads the same registry and SQLite
store, with the same code: the baseline's feature read is Feast's own, not a copy.

It lives apart from headrace's environment (never imported by it, never needed by the
tests), by default under `.headrace/mlserver-venv`. Build it by hand with

    python -m tools.bench.mlserver.env [PATH]

Building takes minutes and needs PyPI; every pip call has a network timeout and the
whole build a time limit. A failure raises `MLServerUnavailable` with pip's last lines.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from schemas.errors import HeadraceError

MLSERVER_VERSION = "1.7.1"
FEAST_VERSION = "0.67.0"
# MLServer's parallel inference workers need uvloop 0.21 (later ones changed the loop
# policy it installs); the baseline runs inline, the pin keeps both settings possible.
UVLOOP_VERSION = "0.21.0"
# Feast's requirements that MLServer pins lower: left to MLServer's versions.
FEAST_SERVER_ONLY = frozenset({"starlette", "fastapi"})
# MLServer 1.7.1 supports Python 3.9 to 3.12.
PYTHON_RANGE = ((3, 9), (3, 12))
PIP_TIMEOUT_S = 60
STEP_TIMEOUT_S = 1_200
SMOKE = "import mlserver, feast, onnxruntime, aiokafka; from feast import FeatureStore"
DEFAULT_VENV = Path(".headrace/mlserver-venv")


class MLServerUnavailable(HeadraceError):
    """The MLServer environment could not be built or used here."""


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def requirements() -> list[str]:
    """What the first step installs: MLServer, uvloop, and ONNX Runtime (CPU build) at
    the version headrace runs, so both run the model with the same library."""
    onnx = None
    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            onnx = metadata.version(name)
            break
        except metadata.PackageNotFoundError:
            continue
    return [
        f"mlserver=={MLSERVER_VERSION}",
        f"uvloop=={UVLOOP_VERSION}",
        f"onnxruntime=={onnx}" if onnx else "onnxruntime",
    ]


def feast_requirements(requires: list[str]) -> list[str]:
    """Feast's own requirements (`Requires-Dist` lines) less extras and the web servers."""
    kept = []
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra ==" in marker:
            continue
        name = requirement.strip()
        for stop in "<>=!~[ (":
            name = name.split(stop, 1)[0]
        if name.lower().replace("_", "-") not in FEAST_SERVER_ONLY:
            kept.append(line.strip())
    return kept


def ensure_venv(venv: Path = DEFAULT_VENV, echo: Callable[[str], None] = print) -> Path:
    """The Python of a complete MLServer environment at `venv`, built if missing or
    built from other requirements. Blocks for minutes when it builds."""
    venv = venv.resolve()
    stamp = venv / "headrace-complete.json"
    wanted = _fingerprint()
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == wanted:
        return python_of(venv)
    low, high = PYTHON_RANGE
    if not low <= sys.version_info[:2] <= high:
        raise MLServerUnavailable(
            f"MLServer {MLSERVER_VERSION} supports Python {low[0]}.{low[1]} to "
            f"{high[0]}.{high[1]}; this is {sys.version.split()[0]}"
        )
    echo(f"building the MLServer {MLSERVER_VERSION} environment in {venv} (minutes)")
    stamp.unlink(missing_ok=True)
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], "create the venv")
    python = str(python_of(venv))
    pip = [python, "-m", "pip", "install", "--timeout", str(PIP_TIMEOUT_S), "--quiet"]
    _run([*pip, *requirements()], "install MLServer")
    _run([*pip, "--no-deps", f"feast=={FEAST_VERSION}"], "install Feast without its dependencies")
    listing = "from importlib.metadata import requires; print('\\n'.join(requires('feast')))"
    requires = _run([python, "-c", listing], "read Feast's requirements").splitlines()
    _run([*pip, f"mlserver=={MLSERVER_VERSION}", *feast_requirements(requires)],
         "install Feast's dependencies")  # fmt: skip
    _run([python, "-c", SMOKE], "import MLServer, Feast and ONNX Runtime")
    stamp.write_text(json.dumps({"fingerprint": wanted, "requirements": requirements()}))
    echo("MLServer environment ready")
    return python_of(venv)


def _fingerprint() -> str:
    """Changes when what the build installs changes (a rebuild follows)."""
    text = json.dumps([requirements(), FEAST_VERSION, sorted(FEAST_SERVER_ONLY),
                       sys.version_info[:2]])  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run(command: list[str], what: str) -> str:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MLServerUnavailable(f"could not {what}: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise MLServerUnavailable(
            f"could not {what} (exit {done.returncode}):\n{tail}\nhint: PyPI must be "
            "reachable; delete the environment's folder to start over"
        )
    return done.stdout


if __name__ == "__main__":
    print(ensure_venv(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_VENV))
