#!/bin/bash
# Issue #18's ZeRO-3 run: the largest Llama shape that fits two H200s, LLaMA-30B/33B (hidden 6656,
# 60 layers, 52 heads, intermediate 17920, vocab 32000: 32.5B parameters, 65 GB in bf16), relayer
# on both GPUs, ZeRO-3, 2 body layers a phase, pre-warming on (depth 1), 3 phases x 5 steps. ZeRO-3
# takes today's path (the handover falls back), so this measures that path's switches and memory.
# One device command, after ../shared/device/make-wheels.sh has filled .whl/:
#
#     run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_zero3.sh")
#
# Expected (not yet run; the first 30B run on this code):
#   wheels ~15 s; the model made on GPU 0 directly in bf16 (~5 s) and written as 13 safetensors
#   shards of 5 GB (65 GB: ~60-120 s, the disk's speed decides); relayer: the fork server reads
#   the 65 GB (page cache) ~30-60 s, each phase's ZeRO-3 engine build partitions the model over
#   the 2 GPUs (tens of seconds, unmeasured at this size), steps ~1-2 s. ~5-8 min in all: close to
#   the 10-minute limit, hence depth 1, 3 phases and --timeout; results are written after the run
#   and packed every 20 s, so a cut-off still brings back the model's time and the logs.
# Host memory (256 GB): the fork server's copy of the weights (65 GB, shared copy-on-write with
# every phase; at ZeRO-3 no phase copies them into a pinned buffer) plus the page cache; pre-warm
# depth 1 keeps at most two phase groups (4 processes) alive.
# $OUT gets results.tgz (results, logs, records; no checkpoints) and zero3.log.
# Extra arguments go to switch.py (e.g. --phases 4 --steps 3, or --prewarm-depth 2).
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s)
S=/tmp/hb3
mkdir -p "$S/results" "$S/logs"
exec > >(tee "$OUT/zero3.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA numbers the GPUs as NVML does (switch.py samples through NVML)
IFS=, read -r -a GPU <<< "${CUDA_VISIBLE_DEVICES:-0,1}"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
free -g | head -2; df -h /tmp | tail -1; nproc

pack() {
    (cd "$S" && find results logs work -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' \
        -o -name '*.log' -o -name '*.toml' \) -not -name train.jsonl -size -8M -not -path '*/checkpoints/*' 2>/dev/null \
        | tar -czf "$OUT/.results.tgz" -T - 2>/dev/null) && mv -f "$OUT/.results.tgz" "$OUT/results.tgz"
}
(while sleep 20; do pack; free -g | sed -n 2p > "$S/logs/free-$(( $(date +%s) - T0 )).log"; done) &
PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT

echo "[run_zero3 $(( $(date +%s) - T0 )) s] the 30B model on GPU 0"
CUDA_VISIBLE_DEVICES=${GPU[0]} python3 benchmarks/switch.py --shape 30b --prepare-only \
    --model-dir "$S/m-30b" --bare-json "$S/results/bare.json" --timeout 400 2>&1 | tee "$S/logs/make-30b.log"
echo "[run_zero3 $(( $(date +%s) - T0 )) s] relayer, ZeRO-3 on 2 GPUs"
CUDA_VISIBLE_DEVICES=${GPU[0]},${GPU[1]} python3 benchmarks/switch.py --shape 30b --zero-stage 3 --nproc 2 --ways a \
    --model-dir "$S/m-30b" --bare-json "$S/results/bare.json" --prewarm-depth 1 --phases 3 --steps 5 \
    --results-dir "$S/results" --out 30b-2gpu-zero3 --work "$S/work/30b" --timeout 480 "$@" 2>&1 \
    | tee "$S/logs/30b-2gpu-zero3.log"
echo "[run_zero3 $(( $(date +%s) - T0 )) s] done"
