#!/usr/bin/env bash
# Fetch into .whl/ the wheels a lent GPU machine lacks (its image has torch, numpy, pandas, msgpack, tqdm,
# accelerate, safetensors, prometheus-client; not our transformers pin, pyzmq, gguf, plotly or the serve extra),
# at the versions this environment runs, built for the machine's Python 3.12. gpu_check.sh installs them there.
#   bash benchmarks/gpu_wheels.sh          # then carry .whl with each device call
set -eu
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
# our pins and their needs that the image lacks or holds too old (huggingface-hub 2 needs httpx2 -> httpcore2)
names="transformers huggingface_hub tokenizers httpx2 httpcore2 truststore pyzmq gguf plotly fastapi starlette
       uvicorn pydantic pydantic_core typing-inspection annotated-types opentelemetry-api typer idna anyio h11
       typing_extensions click"
mkdir -p .whl
grep -qx "/.whl/" .gitignore || echo "warning: .whl/ is not ignored; it must not be committed"
for name in $names; do
  version=$("$python" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "not installed here: $name (run make setup)"; exit 1; }
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl
du -sh .whl
