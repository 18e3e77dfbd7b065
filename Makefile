# Two commands do all set-up: `make demo` and `make test`. Both create/update .venv first (so does `make mutants`).
# `make demo` installs ditmesh alone; `make test` adds the test extra (pytest, peft, the serve front end ...).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch on machines without CUDA; a machine that already has torch keeps it.
TORCH_SPEC ?= torch==2.13.0
BASE_STAMP := $(VENV)/.ditmesh-installed
TEST_STAMP := $(VENV)/.ditmesh-test-installed
# what `make test` runs (a folder or test files)
TESTS ?= tests
# pytest-xdist workers, each taking whole files: much of the suite waits on the processes it starts (imports, a
# server's readiness), and a second worker fills that time on two cores; XDIST=0 runs every test in one process
XDIST ?= 2

.PHONY: demo test mutants install clean

$(BASE_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e .
	touch $(BASE_STAMP)

$(TEST_STAMP): $(BASE_STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $(TEST_STAMP)

install: $(BASE_STAMP)

demo: $(BASE_STAMP)
	$(VENV)/bin/ditmesh generate --nproc 2 --ulysses 2 --out out/demo.png --report out/demo.json

# what the whole suite runs alone after the rest (TESTS=tests): the Ray cluster's tests time rebuilds and scaling on
# nodes pinned to one core each, which a second worker's load on the same two cores starved into timeouts (CI: a
# rebuild tried twice; a scaled replica not rebuilt within 300 s)
ALONE := tests/test_serve_ray.py

# pytest's exit code is written to $(PYTEST_RC) when it is set (.ci/run reads it: make itself returns 2 on any failure;
# with the Ray tests run apart, the first non-zero code of the two runs)
test: $(TEST_STAMP)
	@if [ "$(TESTS)" = tests ]; then \
	  $(PY) -m pytest -q -p no:cacheprovider -n $(XDIST) --dist loadfile --ignore=$(ALONE) tests; rc=$$?; \
	  $(PY) -m pytest -q -p no:cacheprovider $(ALONE); rc2=$$?; [ $$rc = 0 ] && rc=$$rc2; \
	else \
	  $(PY) -m pytest -q -p no:cacheprovider -n $(XDIST) --dist loadfile $(TESTS); rc=$$?; \
	fi; \
	if [ -n "$(PYTEST_RC)" ]; then echo $$rc > "$(PYTEST_RC)"; fi; exit $$rc

# Plants each hand-listed bug of the parallel core (scripts/mutants.py) in a temporary copy of src/ and runs the tests
# that must catch it; the sampled, systematic check is `python scripts/mutate.py --budget-min N` (docs/testing.md).
mutants: $(TEST_STAMP)
	$(PY) scripts/mutate.py --hand

clean:
	rm -rf out .pytest_cache
