# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

# --no-compile: pip would byte-compile every module of torch and transformers (minutes here); Python
# compiles, once, only what is imported.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The debug model on this Python's standard library, 2 local processes, a fresh run directory each time.
demo: $(STAMP)
	$(VENV)/bin/fivefold train configs/debug.toml --nproc 2 --run.name=debug-$$(date +%Y%m%d-%H%M%S)

# Browser tests (tests/test_pages.py) need Debian's chromium + chromium-driver: installed if missing.
test: $(STAMP)
	bash scripts/install-browser.sh
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs build *.egg-info
