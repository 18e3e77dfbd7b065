# Two commands do all set-up: `make demo` and `make test`. Both create/update .venv first (so does `make mutants`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch on machines without CUDA; a machine that already has torch keeps it.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.ditmesh-installed

.PHONY: demo test mutants install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ditmesh generate --nproc 2 --ulysses 2 --out out/demo.png --report out/demo.json

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

# Plants each hand-listed bug of the parallel core (scripts/mutants.py) in a temporary copy of src/ and runs the tests
# that must catch it; the sampled, systematic check is `python scripts/mutate.py --budget-min N` (docs/testing.md).
mutants: $(STAMP)
	$(PY) scripts/mutate.py --hand

clean:
	rm -rf out .pytest_cache
