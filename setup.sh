#!/usr/bin/env bash
# Installs rayfl and everything it needs on a fresh machine (idempotent; fast when done before).
# - Fashion-MNIST from Debian's dataset-fashion-mnist package when apt is usable (offline-friendly);
#   elsewhere the loader falls back to torchvision's download.
# - Optionally Debian's chromium (headless), which the `rayfl report` browser test uses; the test
#   skips, saying why, where it cannot be installed.
# - The package with its dev tools (pytest, ruff, mypy) in editable mode.
set -euo pipefail
cd "$(dirname "$0")"

# apt_install PACKAGE FALLBACK_MESSAGE: install a Debian package when apt is usable (root or sudo).
apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
  [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ] || return 0
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q --no-install-recommends "$1" >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends "$1" >/dev/null; } \
    || echo "setup.sh: could not install $1; $2" >&2
}

[ -d /usr/share/datasets/fashion-mnist ] \
  || apt_install dataset-fashion-mnist "rayfl will try torchvision's download"
command -v chromium >/dev/null 2>&1 \
  || apt_install chromium "optional: the report's browser test will skip"

python3 -m pip install -q --disable-pip-version-check -e ".[dev]"
