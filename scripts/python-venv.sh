#!/usr/bin/env bash
# Creates (once) the Python virtual environment the tests use and prints its python.
# Usage: scripts/python-venv.sh [DIR]   (default: target/py-venv)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/target/py-venv}"
req="$root/scripts/requirements-test.txt"
stamp="$dir/.requirements"
if [ ! -x "$dir/bin/python" ] || ! cmp -s "$req" "$stamp"; then
  python3 -m venv "$dir" >&2
  "$dir/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
  cp "$req" "$stamp"
fi
echo "$dir/bin/python"
