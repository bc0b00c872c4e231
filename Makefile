# The README's two commands: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
# The torch pair to install: constraints.txt pins the newest the course is tested with; constraints-oldest.txt the
# oldest it supports (pyproject's floor), which `make test-oldest` (CI) checks in a venv of its own.
CONSTRAINTS ?= constraints.txt
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test test-oldest unit notebooks browser bench export audit readme timings clean-outputs clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=/dev/null $(PY) -m pip install -q --upgrade pip "setuptools>=77"
	PIP_CONSTRAINT=/dev/null $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# Jupyter refuses to run as root unless told (containers often are root).
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS) notebooks/

# A hang that no test's own timeout sees (a notebook runner waiting on a kernel that went idle, jupyter/nbclient#312)
# ends each phase of `make test` after 40 minutes instead of running on (where GNU timeout exists).
GUARD := $(shell command -v timeout >/dev/null 2>&1 && echo timeout --kill-after=30 2400)

test: unit notebooks

unit: $(STAMP)
	$(GUARD) $(PY) -m pytest tests/ $(UNIT_ARGS)

# The same unit tests (the browser test is left to the newest pair) and notebooks on the oldest supported torch.
test-oldest:
	$(MAKE) unit notebooks VENV=.venv-oldest CONSTRAINTS=constraints-oldest.txt UNIT_ARGS=--ignore=tests/test_browser.py

# JupyterLab in headless chromium: Run All in every notebook, then the panels clicked (also part of `make test`).
browser: $(STAMP)
	$(PY) -m pytest -s tests/test_browser.py

# Smoke mode shrinks every notebook's sizes so the suite runs in minutes on 2 CPU cores.
notebooks: $(STAMP)
	SMOKE_TEST=1 $(GUARD) $(PY) -m pytest --nbmake --nbmake-timeout=600 notebooks/

bench: $(STAMP)
	$(PY) scripts/bench_train_loop.py
	$(PY) scripts/bench_launch.py

# Code a notebook introduces (cells whose first line is `#| export helpers/<module>.py`) is written into helpers/.
export:
	$(PYTHON) scripts/export.py

# Per notebook: reading words, share in code strings, figures, links, exercises, solutions; lessons off the page.
audit:
	$(PYTHON) scripts/course_audit.py

# README.md's notebook table, from each notebook's header (title, "Runs on:", time): one source for both.
readme:
	$(PYTHON) scripts/course_audit.py --readme

# Every notebook run at full size and timed; each header's time (and so the README's) rewritten from the run.
# Run it on a quiet machine: the executed copies stay in /tmp/full so each printed verdict can be read.
timings: $(STAMP)
	$(PY) scripts/time_notebooks.py --keep /tmp/full $(if $(ONLY),--only $(ONLY),)

clean-outputs: $(STAMP)
	$(VENV)/bin/jupyter nbconvert --clear-output --inplace notebooks/*.ipynb

clean:
	rm -rf $(VENV) .venv-oldest
