#!/usr/bin/env bash
# Installs rayfl and everything it needs on a fresh machine (idempotent; fast when done before).
# - Fashion-MNIST from Debian's dataset-fashion-mnist package when apt is usable (offline-friendly);
#   elsewhere the loader falls back to torchvision's download.
# - The package with its dev tools (pytest, ruff, mypy) in editable mode.
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
      || echo "setup.sh: could not install dataset-fashion-mnist; rayfl will try torchvision's download" >&2
  fi
fi

python3 -m pip install -q --disable-pip-version-check -e ".[dev]"
