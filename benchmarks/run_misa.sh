#!/bin/bash
# Issue #46's module units on a GPU: benchmarks/switch.py at 7B (bf16, batch 4 x 512, ZeRO 0), the
# same 5 phases x 20 steps once as MISA (module units drawn uniformly to MISA_BUDGET, default 0.03, of
# the body's parameters; every switch through the checkpoint) and once as LISA (2 layers a phase, 6.25 %
# of the body; relayer's defaults: its switches on the device), one model made for both. Each run's
# NVML trace, its phases' torch peaks and the plan's estimate land in results.json. From the project
# root, once ../shared/device/make-wheels.sh has filled .whl/:
#
#     run(kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_misa.sh")
#
# On a CPU, for trying the script itself: OUT=/tmp/o DS_ACCELERATOR=cpu MISA_TINY=1 bash benchmarks/run_misa.sh
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s)
S=${MISA_SCRATCH:-/tmp/misa}
BUDGET=${MISA_BUDGET:-0.03}
mkdir -p "$S/results"
exec > >(tee "$OUT/misa.log") 2>&1
PY=${PYTHON:-python3}
if [ -d .whl ] && [ "${DS_ACCELERATOR:-cuda}" = cuda ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} PYTHONUNBUFFERED=1
say() { echo "[run_misa $(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader 2>/dev/null
SHAPE=${MISA_SHAPE:-7b}; [ "${MISA_TINY:-0}" = 1 ] && SHAPE=tiny
finish() {
    tar -czf "$OUT/results-misa.tgz" -C "$S" --exclude='*.safetensors' --exclude=train.jsonl results 2>/dev/null
    rm -rf "$S/model"
    say "done"
}
trap finish EXIT
for way in ${MISA_WAYS:-misa lisa}; do
    extra=(--layers "$way"); [ "$way" = misa ] && extra+=(--module-budget "$BUDGET")
    $PY benchmarks/switch.py --shape "$SHAPE" --ways a "${extra[@]}" --model-dir "$S/model" --work "$S/work-$way" \
        --results-dir "$S/results" --out "$way-$SHAPE" --zero-stage 0 --phases "${MISA_PHASES:-5}" --steps 20 --keep-last 1 --timeout 240
    say "switch.py $way: rc $?"
    rm -rf "$S/work-$way"
done
