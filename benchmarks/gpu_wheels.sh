#!/usr/bin/env bash
# The wheels a GPU call carries in .whl/ (the device tool's `carry`), which gpu_run.sh installs first: what the
# GPU image lacks for the server steps (uvicorn, starlette, python-multipart, websockets, httptools, soundfile and
# its cffi, soxr) and the tokenizer fixture (llama-models), for the image's CPython 3.12. Run here, in the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
platforms=()
for p in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl uvicorn starlette python-multipart websockets httptools soundfile cffi pycparser soxr llama-models==0.3.0
ls .whl
