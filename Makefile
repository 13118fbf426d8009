# The README's two commands: `make demo` (the main job) and `make test` (the test suite). Both set up .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH := torch==2.13.0
export OMP_WAIT_POLICY := PASSIVE

.PHONY: demo test check bench bench-olmo bench-scale bench-train bench-flops bench-s3 bench-ownloop bench-peers install clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	touch $@

# torch first and pinned, so that nothing below resolves (and downloads) another torch.
$(VENV)/.installed: $(VENV)/.torch pyproject.toml constraints.txt
	$(PIP) install -q $(TORCH) -c constraints.txt -e ".[dev]"
	touch $@

# The test extra adds the pre-training frameworks (OLMo-core, torchtitan, Megatron-core) whose own code writes the
# checkpoints that tests/layouts/ merges; torch stays pinned on the same line.
$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml constraints.txt
	$(PIP) install -q $(TORCH) -c constraints.txt -e ".[test]"
	touch $@

# megatron-core 0.17 to 0.19 (what users run today) beside the pinned 0.16.1: their wheels are for Python 3.12, their
# code runs on 3.11 (the only compiled part, the dataset helpers, is unused), so the tests run their own save and load
# code from these folders, first on PYTHONPATH (tests/layouts/conftest.py). pip download checks the wheel's hash.
MCORE_RELEASES := 0.17.1 0.18.2 0.19.2
MCORE19 := $(VENV)/mcore-0.19
MCORE_DIRS := $(foreach v,$(MCORE_RELEASES),$(VENV)/mcore-$(basename $(v)))
$(VENV)/mcore-%/.unpacked: | $(VENV)/.torch
	rm -rf $(VENV)/mcore-$* && mkdir -p $(VENV)/mcore-$*/wheel
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 -d $(VENV)/mcore-$*/wheel \
		megatron-core==$(filter $*.%,$(MCORE_RELEASES))
	$(PY) -m zipfile -e $(VENV)/mcore-$*/wheel/megatron_core-$(filter $*.%,$(MCORE_RELEASES))-*.whl $(VENV)/mcore-$*
	touch $@

install: $(VENV)/.installed

# Headless Chromium for the HTML report test (tests/test_report.py): apt-get installs it when run as root;
# otherwise a note is printed and that one test skips. The stamp is written only once a browser is present.
HAVE_CHROMIUM := command -v chromium || command -v chromium-browser || command -v google-chrome
$(VENV)/.chromium: | $(VENV)/.torch
	@($(HAVE_CHROMIUM)) >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the HTML report test (apt-get)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
		echo "note: could not install chromium; the HTML report screenshot test will be skipped"; \
	else \
		echo "note: chromium not found and not root; install it (e.g. apt-get install chromium) to run the HTML report screenshot test, which is skipped otherwise"; \
	fi
	@if ($(HAVE_CHROMIUM)) >/dev/null 2>&1; then touch $@; fi

demo: install
	$(VENV)/bin/pmakit experiment -o runs/demo

# Both cores: pytest-xdist, with the tests that share a session- or module-scoped fixture (a framework's training
# run, the study's smoke run) kept on one worker (tests/conftest.py gives them an xdist_group).
test: $(VENV)/.installed-test $(VENV)/.chromium $(addsuffix /.unpacked,$(MCORE_DIRS))
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=25

check: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

# A small default (8 x 0.61 GB snapshots); the issue's size: make bench BENCH_ARGS=--full
bench: install bench-olmo
	$(PY) benchmarks/bench_merge.py $(BENCH_ARGS)

# pmakit vs OLMo-core's offline merge (whole fp32 state in memory) on checkpoints OLMo-core itself writes
bench-olmo: $(VENV)/.installed-test
	$(PY) benchmarks/bench_olmo_merge.py

# The peers on their own formats, one run: Megatron-LM's weighted_merge.py (read from a Megatron-LM git mirror,
# skipped without one), OLMo-core's offline merge and mergekit linear, each against `pmakit merge`
bench-peers: $(VENV)/.installed-test $(MCORE19)/.unpacked
	$(PY) benchmarks/bench_peers.py $(PEERS_ARGS)

# Merge from a local S3 server (moto) vs the same files on disk: the ratio, peak memory and the requests
# Twice: the server on the merge's cores (both on all of them), then on a core of its own (as a remote store is)
bench-s3: $(VENV)/.installed-test
	$(PY) benchmarks/bench_s3.py
	$(PY) benchmarks/bench_s3.py --store-cpus 0

bench-scale: install
	$(PY) benchmarks/bench_scale.py

# Training overhead of snapshots + the online merge at the demo's size
bench-train: install
	$(PY) benchmarks/bench_train.py

# The demo's training FLOP/s against this machine's measured matmul peak (fp32; bf16 beside it)
bench-flops: install
	$(PY) benchmarks/bench_flops.py

# A user's own loop (docs/training.md) with torch imported before pmakit vs after, busy processes spinning beside it
bench-ownloop: install
	$(PY) benchmarks/bench_ownloop.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
