# One command sets up and runs the main job (`make demo`); one sets up and runs every test (`make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specbench-installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first, so no dependency pulls a multi-GB CUDA build on CPU machines.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m ipykernel install --user --name specbench --display-name "specbench" >/dev/null
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m specbench.cli demo

test: setup
	$(PY) -m specbench.cli models fetch smollm2-135m
	CI=1 $(PY) -m pytest -q -p no:cacheprovider --nbmake tests notebooks

bench: setup
	$(PY) benchmarks/local_sd.py

clean:
	rm -rf $(VENV)
