# The README's two commands: `make demo` (the main job) and `make test` (the test suite). Both set up .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH := torch==2.13.0
export OMP_WAIT_POLICY := PASSIVE

.PHONY: demo test check bench install clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	touch $@

# torch first and pinned, so that nothing below resolves (and downloads) another torch.
$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -q $(TORCH) -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/pmakit demo

test: install
	$(PY) -m pytest -q

check: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

bench: install
	$(PY) benchmarks/bench_merge.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
