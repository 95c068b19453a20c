#!/usr/bin/env bash
# Materialize the sample features into the online store, then run a headrace command
# (by default `headrace worker`; see CMD in the Dockerfile) as PID 1 so it gets SIGTERM.
set -euo pipefail

headrace features prepare -c "$HEADRACE_CONFIG"
exec headrace "$@"
