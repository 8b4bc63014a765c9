#!/bin/bash
# One job twice on the same GPU, side by side: with the code of a base commit and with the checkout's,
# one model made for both (benchmarks/switch.py: LISA, AB_PHASES phases of 20 steps, ZeRO 0, micro-batches
# of 2, relayer's cadence, handover and pre-warming; each run's NVML trace, switches and phases' peaks in
# its results.json). The base is a git archive of launch/, orchestrator/, shard_tools/ and benchmarks/
# carried in out/ab-base (ignored):
#
#     rm -rf out/ab-base && mkdir -p out/ab-base && git archive BASE launch orchestrator shard_tools benchmarks | tar -x -C out/ab-base
#     run(kind="nvidia-h100-x1", carry=[".whl", "out/ab-base"], timeout_s=600, command="bash benchmarks/run_ab.sh")
#
# Then, on the CPU: python benchmarks/plan_vs_nvml.py <results folder> for each side. Trying the script on a
# CPU: OUT=/tmp/o DS_ACCELERATOR=cpu PYTHON=.venv/bin/python AB_SHAPE=tiny AB_PHASES=3 bash benchmarks/run_ab.sh
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s)
if [ "${DS_ACCELERATOR:-cuda}" = cuda ]; then . benchmarks/device_env.sh || exit 1; fi
PY=${PYTHON:-python3}
S=${AB_SCRATCH:-/tmp/ab}
mkdir -p "$S/results"
exec > >(tee "$OUT/ab.log") 2>&1
say() { echo "[run_ab $(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader 2>/dev/null
finish() {
    tar -czf "$OUT/results-ab.tgz" -C "$S" --exclude='*.safetensors' --exclude=train.jsonl results 2>/dev/null
    rm -rf "$S/model"
    say "done"
}
trap finish EXIT
ROOT=$PWD
for side in ${AB_SIDES:-base new}; do
    dir=$ROOT; [ "$side" = base ] && dir=$ROOT/out/ab-base
    (cd "$dir" && PYTHONPATH="/tmp/site:$dir" $PY benchmarks/switch.py --shape "${AB_SHAPE:-7b}" --ways a \
        --layers lisa --model-dir "$S/model" --work "$S/work-$side" --results-dir "$S/results" --out "$side" \
        --zero-stage 0 --phases "${AB_PHASES:-7}" --steps 20 --keep-last 1 --micro-batch 2 --timeout 200)
    say "switch.py $side: rc $?"
    rm -rf "$S/work-$side"
done
