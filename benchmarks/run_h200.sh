#!/bin/bash
# The layer-switch benchmark on the lent H200, in one command. From the project root, after
# ../shared/device/make-wheels.sh has filled .whl/, run on the device (carry .whl):
#
#     bash benchmarks/run_h200.sh                      # all three ways, 1.1B, 8 phases x 20 steps
#     bash benchmarks/run_h200.sh --ways a,b           # extra arguments go to switch.py
#
# (Issue #18's set of runs, on a 2-GPU machine: benchmarks/run_handover.sh.)
# The results (table.md, switch.png, results.json) land in $OUT/DATE-nvidia-h200-1.1b-1proc/, rewritten
# after each way, so a run cut off by the device's time limit still brings back the ways it
# finished; the whole output goes to $OUT/switch.log too.
set -euo pipefail
: "${OUT:?set OUT to the folder the results go to}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export DS_ACCELERATOR=cuda
export PYTHONUNBUFFERED=1
python3 benchmarks/switch.py --results-dir "$OUT" "$@" 2>&1 | tee "$OUT/switch.log"
