#!/bin/sh
# Installs what tests/web needs, for `make test` and CI: Chromium (Debian's package; Playwright
# cannot download browsers here), Node.js and npm when missing (npm ci, and the bundle's Python
# snapshot is made with node: Pyodide needs node 18 or later), the npm packages of
# package-lock.json, and Playwright for Python.
# PYTHON names the test environment's interpreter (default .venv/bin/python); ORTPIPE_CHROMIUM
# names a Chromium already installed elsewhere (default /usr/bin/chromium).
set -eu
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}

PACKAGES=""
[ -x "${ORTPIPE_CHROMIUM:-/usr/bin/chromium}" ] || PACKAGES="chromium"
command -v npm >/dev/null 2>&1 || PACKAGES="$PACKAGES nodejs npm"
if [ -n "$PACKAGES" ]; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -q
    # shellcheck disable=SC2086 # the package names are meant to split
    $SUDO apt-get install -y -q $PACKAGES
fi
npm ci --no-audit --no-fund
"$PYTHON" -m pip install -q playwright==1.65.2 pytest-playwright==0.10.0
