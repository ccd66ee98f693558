# One command sets up and runs the main job (`make demo`); one sets up and runs every test (`make test`);
# `make docs` serves the documentation.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specbench-installed
# the notebooks' kernel, kept in this checkout's environment: a user-level one is shared by every checkout on the
# machine, and another's (since deleted) once shadowed this one. Jupyter reads JUPYTER_PATH before the user's.
KERNEL := $(VENV)/share/jupyter/kernels/specbench/kernel.json
export JUPYTER_PATH := $(abspath $(VENV))/share/jupyter
# `make test` starts ~100 interpreters (workers, clients, kernels, scripts): let them reuse the project's compiled
# bytecode where the environment turned writing it off (0.5-1 s of compiling each)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first, so no dependency pulls a multi-GB CUDA build on CPU machines.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e ".[dev,ray,serve]"
	# bytecode only for what specbench imports, in two processes: pip compiles every installed file on one core
	$(PY) .ci/bytecode.py
	# Chromium + driver for the headless-browser checks (Debian packages; skipped where apt is not ours).
	command -v chromedriver >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver) \
		>/dev/null 2>&1 || echo "note: chromium/chromedriver not installed: browser checks will be skipped"; }
	touch $(STAMP)

$(KERNEL): $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name specbench --display-name "specbench" >/dev/null

setup: $(STAMP) $(KERNEL)

demo: setup
	$(PY) -m specbench.cli demo

test: setup
	$(PY) -m specbench.cli models fetch smollm2-135m
	$(PY) -m specbench.cli models fetch qwen2.5-coder-0.5b  # notebook 05: a target of another family (0.5 GB once)
	# three processes, one thread each, on 2 cores: much of a test's time is waiting on the workers, kernels, scripts
	# and sockets it starts, and a third process fills it (-n 3 ran 16% faster than -n 2 on a 2-vCPU box; -n 4 was
	# slower than both: benchmarks/results/2026-12-02-test-workers-amx.md). Tests that assert a wall-clock bound, or
	# start a Ray cluster (marked `serial`), then run alone, with every core.
	# --durations names the slowest tests in every log (conftest's LONGEST_FIRST is kept from them); without
	# --no-loadscope-reorder xdist hands out files by their number of tests, not in that order.
	CI=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --nbmake -n 3 --dist loadfile --no-loadscope-reorder \
		-m "not serial" --durations=20 tests notebooks
	CI=1 $(PY) -m pytest -q -p no:cacheprovider -m serial tests

bench: setup
	$(PY) benchmarks/local_sd.py

docs: setup  # the documentation site, served at http://127.0.0.1:8000 (tests build it with warnings as errors)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf $(VENV)
