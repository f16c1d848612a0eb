# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo browser test lint clean

# --no-compile: pip would byte-compile every module of torch and transformers (minutes here); Python
# compiles, once, only what is imported. torch==2.13.0: the suite's torch, the CPU wheel on a machine
# without a GPU, within the range pyproject.toml states (2.11 to 2.13).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "torch==2.13.0" -e ".[test,hf,tensorboard,wandb,fp8]"
	touch $(STAMP)

install: $(STAMP)

# The debug model on this Python's standard library, 2 local processes, a fresh run directory each time
# (runs/, debug.toml's run.out_dir default); then a few seconds of text from its last checkpoint.
demo: $(STAMP)
	name=debug-$$(date +%Y%m%d-%H%M%S) && \
	$(VENV)/bin/fivefold train configs/debug.toml --nproc 2 --run.name=$$name && \
	echo "--- fivefold sample runs/$$name --prompt 'def ' --max-new-tokens 120" && \
	$(VENV)/bin/fivefold sample runs/$$name --prompt "def " --max-new-tokens 120

# Browser tests (tests/viz/test_pages.py) need Debian's chromium + chromium-driver, installed if missing
# in the background while pip installs and the other tests run (about a minute of downloads); the
# pages' tests wait for .browser-install.done, which holds the script's exit status.
browser:
	rm -f .browser-install.done
	(bash scripts/install-browser.sh > .browser-install.log 2>&1; echo $$? > .browser-install.done) &

# The tests let Python write its bytecode caches (into .venv and __pycache__/, both ignored by git)
# even where the environment sets PYTHONDONTWRITEBYTECODE: pip installed without them (--no-compile
# above), so every interpreter the tests start (launchers, workers, the README's commands) would
# compile torch's modules again, 5.1 s per start instead of 1.9 s (measured here).
test: browser $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

# ruff: pyflakes, pycodestyle, import order and bugbear, lines of at most 120 characters (pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs build *.egg-info .browser-install.*
