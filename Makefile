# Two entry points: `make demo` (generate with the built-in demo model) and `make test` (the whole suite).
# Both create and fill their own virtual environment.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
DEMO_DIR := build/cache/demo
PROMPT ?= def main(

.PHONY: demo test kernels clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[cpu]' onnx
	touch $@

$(VENV)/.test: requirements/test.txt $(VENV)/.base
	$(PIP) install -r requirements/test.txt
	touch $@

demo: $(VENV)/.base
	$(PY) -m build.demo_model --out $(DEMO_DIR)
	$(VENV)/bin/ortpipe run $(DEMO_DIR) --prompt "$(PROMPT)" --max-new-tokens 60

test: $(VENV)/.test
	$(PY) -m pytest -q -rs

kernels: $(VENV)/.base
	$(PY) -m build.kernels

clean:
	rm -rf $(VENV) .venv-optimum build/cache dist
