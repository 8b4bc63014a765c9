#!/bin/bash
# Issue #18's switch benchmarks on a lent 2-GPU H200 machine, in ONE device command (~6-7 min of
# the 10-minute limit). From the project root, after ../shared/device/make-wheels.sh has filled .whl/:
#
#     run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_handover.sh")
#
# What runs where (8 phases x 20 steps, 2 body layers a phase, bf16, ZeRO-2, batch 4 x 512 a
# process; expected wall times from the 2026-11-30/12-01 H200 runs: a fresh process imports in
# ~15 s, its first deepspeed.initialize takes ~5 s, a 1.1B step ~0.09 s, a 7B step ~0.17 s):
#
#   0. wheels                                                                         ~15 s
#   1. in parallel: GPU 0 makes the 1.1B model (2.2 GB) and measures a bare phase    ~60-90 s
#      process; GPU 1 makes the 7B model (bf16 on the device, 13.5 GB safetensors)
#   2. in parallel:                                                                   ~150-200 s
#      GPU 0: 1.1B, 1 GPU, handover auto (~60 s), then the same with handover off (~60 s)
#      GPU 1: 7B, 1 GPU, handover auto (~70 s), then way b, the in-process rebuild (~60 s),
#             one results.json side by side
#   3. alone: 1.1B on both GPUs, handover auto                                       ~70 s
#   4. summary.md: one line per run (_switch_report.py compare)
#
# The runs of step 2 share the host's 32 cores (and its page cache); each switch.py samples only
# its own GPU (NVML honours CUDA_VISIBLE_DEVICES through switch.py's Devices). Each run writes its
# results.json / table.md / switch.png after each way; a packer refreshes $OUT/results.tgz every
# 20 s (the results, each run's log and its records: journal, records.json, stages.jsonl, worker
# logs; no checkpoints), so a command cut off at its limit still brings back what finished.
# $OUT gets 3 files: results.tgz, summary.md, handover.log (everything printed).
# Extra arguments go to every switch.py (e.g. --phases 6 to shorten all runs). On a CPU, for
# trying the script itself: OUT=/tmp/o HB_SMALL=tiny HB_BIG=tiny DS_ACCELERATOR=cpu bash
# benchmarks/run_handover.sh --phases 3 --steps 3   (the shapes' names stay in the runs' names).
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s)
S=${HB_SCRATCH:-/tmp/hb}
mkdir -p "$S/results" "$S/logs"
exec > >(tee "$OUT/handover.log") 2>&1
SMALL=${HB_SMALL:-1.1b} BIG=${HB_BIG:-7b} PY=${PYTHON:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} PYTHONUNBUFFERED=1
# CUDA numbers the GPUs as NVML does (switch.py samples the GPU it names through NVML), and the
# two GPUs are those the machine shows this command (all of them unless it set CUDA_VISIBLE_DEVICES).
export CUDA_DEVICE_ORDER=PCI_BUS_ID
# One GPU (a machine of kind nvidia-h200): the same runs one after another on it, without step 3.
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
IFS=, read -r -a GPU <<< "${CUDA_VISIBLE_DEVICES:-$([ "$NGPU" = 1 ] && echo 0 || echo 0,1)}"
echo "GPUs: ${GPU[*]}"
nvidia-smi --query-gpu=index,name,uuid,memory.total --format=csv,noheader 2>/dev/null
free -g | head -2; df -h /tmp | tail -1; nproc

say() { echo "[run_handover $(( $(date +%s) - T0 )) s] $*"; }

pack() {  # everything small that a reader of the results may want, in one file
    (cd "$S" && find results logs work -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' \
        -o -name '*.log' -o -name '*.toml' \) -not -name train.jsonl -size -8M -not -path '*/checkpoints/*' -not -path '*/m-*' 2>/dev/null \
        | tar -czf "$OUT/.results.tgz" -T - 2>/dev/null) && mv -f "$OUT/.results.tgz" "$OUT/results.tgz"
}

# switch NAME GPUS ARGS...: one switch.py run on the given GPUs, its output in logs/NAME.log.
switch() {
    local name=$1 gpus=$2
    shift 2
    say "start $name on GPU(s) $gpus: $*"
    CUDA_VISIBLE_DEVICES=$gpus $PY benchmarks/switch.py --results-dir "$S/results" --out "$name" \
        --work "$S/work/$name" --timeout 300 "$@" "${EXTRA[@]}" > "$S/logs/$name.log" 2>&1
    say "end $name: rc $? ($(tail -1 "$S/logs/$name.log"))"
    rm -rf "$S/work/$name/relayer/run/checkpoints" "$S/work/$name/inprocess" "$S/work/$name/naive"/model-*  # disk
}

EXTRA=("$@")
(while sleep 20; do pack; done) &
PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT

ONE=$([ ${#GPU[@]} = 1 ] && echo 1 || echo 0)
[ "$ONE" = 1 ] && GPU[1]=${GPU[0]}
say "1. the models"
CUDA_VISIBLE_DEVICES=${GPU[0]} $PY benchmarks/switch.py --shape $SMALL --prepare-only --model-dir "$S/m-small" \
    --bare-json "$S/results/bare.json" > "$S/logs/make-small.log" 2>&1 &
M1=$!
[ "$ONE" = 1 ] && wait $M1
CUDA_VISIBLE_DEVICES=${GPU[1]} $PY benchmarks/switch.py --shape $BIG --prepare-only --model-dir "$S/m-big" \
    > "$S/logs/make-big.log" 2>&1 &
M7=$!
wait $M1; say "1.1B model: rc $?"
wait $M7; say "7B model: rc $?"
COMMON=(--ways a --bare-json "$S/results/bare.json")

say "2. 1.1B auto / off on GPU 0, 7B auto + in-process on GPU 1"
(switch 1.1b-1gpu-auto "${GPU[0]}" --shape $SMALL --model-dir "$S/m-small" "${COMMON[@]}" --handover auto
 switch 1.1b-1gpu-off "${GPU[0]}" --shape $SMALL --model-dir "$S/m-small" "${COMMON[@]}" --handover off) &
G0=$!
[ "$ONE" = 1 ] && wait $G0
switch 7b-1gpu-auto "${GPU[1]}" --shape $BIG --model-dir "$S/m-big" --bare-json "$S/results/bare.json" --ways a,b \
    --handover auto &
G1=$!
wait $G0 $G1

say "3. 1.1B on 2 GPUs, auto"
[ "$ONE" = 1 ] || switch 1.1b-2gpu-auto "${GPU[0]},${GPU[1]}" --shape $SMALL --model-dir "$S/m-small" "${COMMON[@]}" --nproc 2 --handover auto

say "4. summary"
$PY benchmarks/_switch_report.py compare "$S/results/summary.md" "$S"/results/*/ && cp "$S/results/summary.md" "$OUT/"
cat "$S/results/summary.md"
for d in "$S"/results/*/; do $PY benchmarks/breakdown.py "$d" > /dev/null 2>&1; done
say "done"
