"""The feature stage: the Feast repo, the online lookup and its cache.

Feast 0.67 switches prometheus_client into multiprocess mode when `feast.metrics` is
imported: it points PROMETHEUS_MULTIPROC_DIR at a temp dir of its own (and deletes
it at exit). Child processes inherit that variable and then fail or write their
metrics to files. headrace keeps its metrics in process: drop a variable that Feast
set for a parent process, and bind prometheus_client before Feast can.

Feast also decorates its definition classes with typeguard's `@typechecked`, which at
import re-parses and recompiles each class's source: 4-6 of the 6-9 seconds that
`import feast` takes, paid by every worker start (and so by every failover). headrace
never builds Feast definitions from user code (it reads them from the registry, where
`feast apply` checked them), so its processes import Feast without that instrumentation.
"""

import os
import sys
import tempfile

import typeguard


def _unchecked(target=None, **_options):
    """`typeguard.typechecked` as a no-op: the class or function as it is."""
    return _unchecked if target is None else target


if "feast" not in sys.modules:  # the decorator is looked up when Feast is imported
    typeguard.typechecked = _unchecked

_FEAST_DIR = os.path.join(tempfile.gettempdir(), "feast_metrics_")
for _name in ("PROMETHEUS_MULTIPROC_DIR", "PROMETHEUS_MULTIPROCESS_DIR"):
    if os.environ.get(_name, "").startswith(_FEAST_DIR):
        del os.environ[_name]

import prometheus_client  # noqa: E402, F401  (binds its value class now)
