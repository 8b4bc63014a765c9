#!/bin/bash
# Adds to .whl/ what benchmarks/peer.py needs on the lent GPU machine beyond
# ../shared/device/make-wheels.sh: accelerate (the Hugging Face Trainer needs it) and axolotl, whose
# own LISA callback the peer runs (installed --no-deps: benchmarks/_lisa_callback.py loads only its
# lisa module, which needs numpy, transformers and axolotl's logging helper). Run from the project root.
set -euo pipefail
mkdir -p .whl  # ignored (.gitignore)
for p in accelerate==1.15.0 axolotl==0.21.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p"
done
ls .whl
