# The README's two commands: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
# The torch pair to install: constraints.txt pins the newest the course is tested with; constraints-oldest.txt the
# oldest it supports (pyproject's floor), which `make test-oldest` (CI) checks in a venv of its own.
CONSTRAINTS ?= constraints.txt
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test test-oldest unit notebooks notebooks-after-browser install-venv browser gpu-check bench export audit readme timings clean-outputs clean

# Each phase of `make test` / `make test-oldest` runs under scripts/phase.sh, which appends its name, seconds and exit
# status to $(PHASE_LOG) (.ci/run prints the table at the end).
PHASE_LOG ?= .phase-times
PHASE := PHASE_LOG=$(PHASE_LOG) sh scripts/phase.sh
TORCH_PIN = $(shell sed -n 's/^torch==//p' $(CONSTRAINTS))

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PHASE) "install (torch $(TORCH_PIN))" $(MAKE) --no-print-directory install-venv VENV=$(VENV) CONSTRAINTS=$(CONSTRAINTS)

install-venv:
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
# ends each phase of `make test` after 40 minutes instead of running on (where GNU timeout exists). Each phase takes
# at most 20 minutes on 2 CPU cores (measured: the times are in the closing notes and printed by .ci/run), so a
# machine twice as slow stays inside it.
GUARD := $(shell command -v timeout >/dev/null 2>&1 && echo timeout --kill-after=30 2400)
# The 15 slowest tests of each phase, so that a slow one is seen (tests/test_course.py: none over 60 s unexplained).
DURATIONS ?= --durations=15

# Every test, and every notebook once: the browser test runs the notebooks with a panel (Run All, then the panel
# clicked) and records those that ran clean; nbmake runs the rest, and any the browser test could not run.
test: unit browser notebooks-after-browser

unit: $(STAMP)
	$(PHASE) "unit tests (torch $(TORCH_PIN))" $(GUARD) $(PY) -m pytest tests/ --ignore=tests/test_browser.py \
		$(DURATIONS) $(UNIT_ARGS)

# The oldest supported torch: the unit tests (each equivalence check's plain run; its perturbed reruns are the newest
# torch's, see tests/perturb.py) and every notebook by nbmake (the browser test is left to the newest pair).
test-oldest:
	$(MAKE) unit notebooks VENV=.venv-oldest CONSTRAINTS=constraints-oldest.txt UNIT_ARGS='-m "not perturbed"'

# JupyterLab in headless chromium: Run All in the notebooks with a panel, then the panels clicked. BROWSER_NOTEBOOKS=all
# runs every notebook there (the screenshots of a learner's read), or names them: BROWSER_NOTEBOOKS=04,11.
BROWSER_RAN := $(CURDIR)/.pytest_cache/ran-in-browser.tsv
browser: $(STAMP)
	rm -f $(BROWSER_RAN) && mkdir -p $(dir $(BROWSER_RAN))
	BROWSER_RAN_CLEAN=$(BROWSER_RAN) $(PHASE) "browser test (torch $(TORCH_PIN))" $(GUARD) \
		$(PY) -m pytest -s tests/test_browser.py $(DURATIONS)

# Smoke mode shrinks every notebook's sizes so the suite runs in minutes on 2 CPU cores.
NBMAKE = env SMOKE_TEST=1 $(GUARD) $(PY) -m pytest --nbmake --nbmake-timeout=600 $(DURATIONS)
notebooks: $(STAMP)
	$(PHASE) "notebooks (torch $(TORCH_PIN))" $(NBMAKE) notebooks/

# The same, less the notebooks the browser test has just run clean (tests/ran_in_browser.py checks their bytes).
notebooks-after-browser: $(STAMP)
	PYTHONPATH=tests $(PHASE) "notebooks, nbmake (torch $(TORCH_PIN))" $(NBMAKE) -p ran_in_browser \
		--ran-in-browser $(BROWSER_RAN) notebooks/

# On a GPU machine, one table of what the course's GPU routes do there (scripts/gpu_check.py: about 5 minutes on one
# GPU). Where torch is the machine's own and there is no venv (the lent GPU machine): make gpu-check GPU_PY=python3.
gpu-check:
	@if [ -z "$(GPU_PY)" ]; then $(MAKE) --no-print-directory $(STAMP); fi
	$(or $(GPU_PY),$(PY)) scripts/gpu_check.py

bench: $(STAMP)
	$(PY) scripts/bench_train_loop.py
	$(PY) scripts/bench_launch.py

# Code a notebook introduces (cells whose first line is `#| export helpers/<module>.py`) is written into helpers/.
export:
	$(PYTHON) scripts/export.py

# Per notebook: reading words, share in code strings, figures, links, exercises, solutions; lessons off the page.
audit: $(STAMP)
	$(PY) scripts/course_audit.py

# README.md's notebook table, from each notebook's header (title, "Runs on:", time): one source for both.
readme: $(STAMP)
	$(PY) scripts/course_audit.py --readme

# Every notebook run at full size and timed; each header's time (and so the README's) rewritten from the run.
# Run it on a quiet machine: the executed copies stay in /tmp/full so each printed verdict can be read.
timings: $(STAMP)
	$(PY) scripts/time_notebooks.py --keep /tmp/full $(if $(ONLY),--only $(ONLY),)

clean-outputs: $(STAMP)
	$(VENV)/bin/jupyter nbconvert --clear-output --inplace notebooks/*.ipynb

clean:
	rm -rf $(VENV) .venv-oldest
