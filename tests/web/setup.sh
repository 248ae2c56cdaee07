#!/bin/sh
# Installs what tests/web needs, for `make test` and CI: Chromium (Debian's package; Playwright
# cannot download browsers here), the npm packages of package-lock.json, and Playwright for Python.
# PYTHON names the test environment's interpreter (default .venv/bin/python); ORTPIPE_CHROMIUM
# names a Chromium already installed elsewhere (default /usr/bin/chromium).
set -eu
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}

if [ ! -x "${ORTPIPE_CHROMIUM:-/usr/bin/chromium}" ]; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q chromium
fi
npm ci --no-audit --no-fund
"$PYTHON" -m pip install -q playwright==1.65.2 pytest-playwright==0.10.0
