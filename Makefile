# Two entry points: `make demo` (generate with the built-in demo model) and `make test` (the whole suite).
# Both create and fill their own virtual environment.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
DEMO_DIR := models/demo
PROMPT ?= def main(

.PHONY: demo test kernels clean web emulate-arm64

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[cpu]' onnx
	touch $@

$(VENV)/.test: requirements/test.txt $(VENV)/.base
	$(PIP) install -r requirements/test.txt
	touch $@

# the committed demo model (build/train_demo.py trains and exports it; see models/demo/TRAINING.md)
demo: $(VENV)/.base
	$(VENV)/bin/ortpipe run $(DEMO_DIR) --prompt "$(PROMPT)" --max-new-tokens 60

# the browser tests' tools: Debian's chromium, npm packages, playwright
$(VENV)/.web: package-lock.json tests/web/setup.sh $(VENV)/.test
	PYTHON=$(PY) sh tests/web/setup.sh
	touch $@

# the lint gate first (the project's ruff settings, pyproject.toml), then the whole suite
test: $(VENV)/.test $(VENV)/.web
	$(VENV)/bin/ruff check py build tests
	$(PY) -m pytest -q -rs

web: $(VENV)/.base
	npm ci --no-audit --no-fund
	$(PY) -m build.web $(MODELS)
	$(VENV)/bin/ortpipe web --coop

# installs the wheel with ortpipe[cpu] from PyPI in an emulated Debian arm64 (the base of Raspberry Pi OS 64-bit)
# and checks the demo model's tokens against this machine's; needs root (README, "On edge devices")
emulate-arm64: $(VENV)/.base
	PYTHON=$(PY) bash edge/emulate-arm64.sh

kernels: $(VENV)/.base
	$(PY) -m build.kernels

clean:
	rm -rf $(VENV) .venv-optimum .venv-paradigms-export .venv-paradigms-ref build/cache dist
