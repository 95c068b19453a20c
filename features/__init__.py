"""The feature stage: the Feast repo, the online lookup and its cache.

Feast 0.67 switches prometheus_client into multiprocess mode when `feast.metrics` is
imported: it points PROMETHEUS_MULTIPROC_DIR at a temp dir of its own (and deletes
it at exit). Child processes inherit that variable and then fail or write their
metrics to files. headrace keeps its metrics in process: drop a variable that Feast
set for a parent process, and bind prometheus_client before Feast can.
"""

import os
import tempfile

_FEAST_DIR = os.path.join(tempfile.gettempdir(), "feast_metrics_")
for _name in ("PROMETHEUS_MULTIPROC_DIR", "PROMETHEUS_MULTIPROCESS_DIR"):
    if os.environ.get(_name, "").startswith(_FEAST_DIR):
        del os.environ[_name]

import prometheus_client  # noqa: E402, F401  (binds its value class now)
