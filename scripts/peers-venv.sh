#!/usr/bin/env bash
# Installs (once) the peer routers from PyPI into a venv and prints its bin directory.
# Usage: scripts/peers-venv.sh [DIR]   (default: target/peers-venv)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/target/peers-venv}"
req="$root/scripts/requirements-peers.txt"
stamp="$dir/.requirements"
if [ ! -x "$dir/bin/python" ] || ! cmp -s "$req" "$stamp"; then
  python3 -m venv "$dir" >&2
  "$dir/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
  cp "$req" "$stamp"
fi
echo "$dir/bin"
