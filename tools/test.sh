#!/usr/bin/env bash
# The fast test suite: creates .venv when missing (reinstalls when setup.py changed), then runs
# every test not marked slow or gpu. Extra arguments go to pytest, e.g. `bash tools/test.sh -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env.sh
exec python -m pytest -m "not slow and not gpu" tests "$@"
