#!/bin/bash
# Issue #29's runs on a lent H200, one step a device command, each under 9 minutes. From the project
# root, once ../shared/device/make-wheels.sh and benchmarks/peer-wheels.sh have filled .whl/:
#
#     run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue29.sh peer7b")
#     run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue29.sh lisa7b")
#     run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue29.sh big")
#
# Steps, and their device time estimated from benchmarks/results/2026-12-01-handover-h200 (a fresh
# process imports in ~15 s, a 7B step takes ~0.17 s, a 7B switch ~0.25 s, the 1.1B+7B models were
# made in 60-90 s) and the sizes _space.py computes (bf16 weights: 13.5 GB at 7B, 26 GB at 13B, 65 GB
# at 30B; a phase-end checkpoint 4.8 / 6.5 / 9.4 GB); about 17 minutes for all three:
#
#   peer7b  ~5.5 min  benchmarks/peer.py at 7B, 200 steps each way: wheels 15 s; the model made on
#                     the GPU and written to /dev/shm 40-60 s; the peer (HF Trainer + axolotl's LISA
#                     callback) ~15 s imports + 200 x ~0.17 s + ~30 s saving 13.5 GB; relayer ~30 s to
#                     its first step + 11 phases x ~3.6 s + ~40-60 s for RUN_DIR/final; report 10 s.
#   peer7be ~5.5 min  peer7b with relayer's checkpoint at every phase end (every_seconds 0).
#   lisa7b  ~3 min    benchmarks/switch.py --layers lisa at 7B, 13 phases (12 switches) x 20 steps:
#                     the model reused from /dev/shm where peer7b ran on this machine (else ~60 s to
#                     make), a bare process ~20 s, relayer ~30 s + 13 x ~3.6 s; per switch the
#                     offer, the go, the successor's read of it and its answer, the journal lines, the
#                     page cache under writeback and the main threads' kernel waits around each go
#                     (benchmarks/_switch_gaps.py), py-spy stacks of late ones; breakdown.md.
#   diag0   ~6 min    step7b's step at deepspeed.zero_stage = 0 beside ZeRO-2's and the peer's, lisa7b0, and 5
#                     phases of it with the switch and the first two steps of each phase profiled.
#   stage0  ~8 min    the kernel's test on the GPU, step7b's step at stage 0 (kernel and torch), lisa7b0, peer7b0.
#   lisa7b0 ~3 min    lisa7b at deepspeed.zero_stage = 0 (relayer's own AdamW over fp32 masters, no ZeRO).
#   peer7b0 ~5 min    peer7be with relayer at deepspeed.zero_stage = 0.
#   step7b  ~2 min    benchmarks/step_cost.py at 7B: one steady step way by way in one process
#                     (relayer's engine, fused AdamW, ZeRO-1, the peer's bf16 step, forward and backward
#                     alone), with each way's top operators by device time; the model made on the GPU.
#   big     ~8 min    13B (big13) then ~30B (big30); either alone where big would pass 9 minutes:
#   big13   ~3.5 min    Llama-2-13B, 8 phases x 20 steps, LISA's layers, handover auto, the micro batch
#                       the plan's overlap fits 90% of the device with (1; the batch stays 4): the model
#                       to /dev/shm ~60 s, relayer ~40 s + 8 x ~10 s.
#   big30   ~5 min      LLaMA-30B (32.5B), 4 phases x 5 steps: two phases do not fit the device, so every
#                       switch goes through the checkpoint, and a phase pre-warmed for that path holds a
#                       pinned copy of the weights (65 GB) beside the model in /dev/shm (65 GB): the
#                       host's 128 GiB leaves no room, so pre-warming is off (_space.py decides it, and
#                       the plan with pre-warming on is recorded too). The model to /dev/shm ~120 s,
#                       relayer ~60 s + 4 x (~15-25 s cold start + 5 x ~1 s).
#
# Where things go (_space.py, from the free disk, /dev/shm and host memory it finds): the model in
# /dev/shm (the 64 GB disk holds the checkpoints: retention keeps every checkpoint that holds the
# newest copy of a layer, 50-60 GB over 11-13 LISA phases at 7B), the run on the disk where it
# fits, else in /dev/shm too (said in the log and results). Every step removes its runs; the 7B
# model stays in /dev/shm for lisa7b; big removes it first.
# $OUT gets: STEP.log (everything printed), results.tgz (results.json, table.md, PNGs, breakdown.md,
# the runs' journals, records and logs; no checkpoints), README.md (benchmarks/_issue29_readme.py over
# the results so far), and peer7b.png / peer7b-every-phase.png for the peer steps; a packer refreshes results.tgz every 20 s, so a step
# cut off at the device's limit still brings back what it measured.
# On a CPU, for trying the script itself (tiny shapes, a few minutes each):
#     OUT=/tmp/o DS_ACCELERATOR=cpu I29_TINY=1 bash benchmarks/run_issue29.sh peer7b
set -uo pipefail
STEP=${1:?usage: run_issue29.sh issue41|resident7b|cadence11|peer7b|peer7be|peer7b0|lisa7b|lisa7b0|step7b|diag0|stage0|step0|lisa13|big|big13|big30|long11|long11s|long11e|long7|long7c}
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s)
S=${I29_SCRATCH:-/tmp/i29}
SHM=${I29_SHM:-/dev/shm/i29}
mkdir -p "$S/results" "$S/logs" "$SHM"
exec > >(tee "$OUT/$STEP.log") 2>&1
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} PYTHONUNBUFFERED=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID
say() { echo "[run_issue29 $STEP $(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader 2>/dev/null
free -g | head -2; df -h "$S" "$SHM" | tail -2; nproc
DEVICE_BYTES=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
DEVICE_BYTES=$(( ${DEVICE_BYTES:-1048576} * 1048576 ))  # no GPU (a try on a CPU): no device limit
TINY=${I29_TINY:-0}
TINY_ARGS=()
[ "$TINY" = 1 ] && TINY_ARGS=(--phases 3 --steps 3)  # the last of an option counts

pack() {  # each packer its own temporary: one killed mid-way leaves nothing that the last one renames
    local tmp="$OUT/.results-$BASHPID.tgz"
    (cd "$S" && find results logs work -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' \
        -o -name '*.log' -o -name '*.toml' -o -name '*.txt' \) -not -name train.jsonl -size -8M \
        -not -path '*/checkpoints/*' -not -path '*/final/*' 2>/dev/null | tar -czf "$tmp" -T - 2>/dev/null) \
        && mv -f "$tmp" "$OUT/results.tgz"
}
(while sleep 20; do pack; done) &
PACKER=$!
finish() {
    kill $PACKER 2>/dev/null
    wait $PACKER 2>/dev/null  # a packer cut off mid-way must not rename its older archive over the last one
    $PY benchmarks/_issue29_readme.py "$S/results" "$S/results/README.md" && cp "$S/results/README.md" "$OUT/"
    for png in "$S"/results/peer7b*/peer.png; do [ -f "$png" ] && cp "$png" "$OUT/$(basename "$(dirname "$png")").png"; done
    pack
    # The results alone, once more, whatever became of the packer's archive (one came back without them).
    tar -czf "$OUT/results-$STEP.tgz" -C "$S" results 2>/dev/null
    rm -f "$OUT"/.results-*.tgz  # at most 8 files come back
    say "done"
}
trap finish EXIT

# space SHAPE ARGS...: where the model and the run go, the micro batch and pre-warm depth (_space.py).
# shape SHAPE: the shape, or tiny when trying the script on a CPU (I29_TINY=1).
space() {
    local out
    out=$($PY benchmarks/_space.py --shape "$(shape "$1")" --disk "$S" --shm "$SHM" --device-memory "$DEVICE_BYTES" \
          "${@:2}" --shell) || { say "does not fit: $out"; return 1; }
    eval "$out"
    say "$(shape "$1"): $WHY; micro batch $MICRO, prewarm_depth $DEPTH, handover fits: $HANDOVER_FITS"
    mkdir -p "$WORK_DIR"
}

shape() { [ "$TINY" = 1 ] && echo tiny || echo "$1"; }

peer7b() { peer 7b peer7b; }
# peer7b with a checkpoint at every phase end (every_seconds 0), not the cadence's one at the run's
# end: the cadence's carried layers and its end-of-run write left out of the comparison.
peer7be() { peer 7b peer7b-every-phase --every-seconds 0; }

# peer SHAPE NAME ARGS...: one peer.py run (relayer and the peer, one after the other), removed after.
peer() {
    local sh=$1 name=$2
    shift 2
    # keep_last 1: the plan's peak (since 2026-12-02 it counts up to keep_last checkpoints of every
    # layer trained, 72.6 GiB with 2) must fit the 64 GB disk beside the final model.
    space "$sh" --layers lisa --phases 11 --final-model --peer-output --handover || exit 3
    $PY benchmarks/peer.py --shape "$(shape "$sh")" --model-dir "$MODEL_DIR" --outputs "$WORK_DIR" \
        --work "$S/work/$name" --micro-batch "$MICRO" --results-dir "$S/results" --out "$name" --timeout 420 \
        --callback auto --keep-last 1 "$@"
    say "peer.py $name: rc $?"
    rm -rf "$S/work/$name" "$WORK_DIR"
}

# switch NAME SHAPE ARGS...: one switch.py run of relayer alone, its run removed after.
switch() {
    local name=$1 sh=$2
    shift 2
    say "switch.py $name: $*"
    $PY benchmarks/switch.py --shape "$(shape "$sh")" --ways a --layers lisa --model-dir "$MODEL_DIR" \
        --work "$WORK_DIR/$name" --results-dir "$S/results" --out "$name" --bare-json "$S/results/bare.json" \
        --handover auto "$@" "${TINY_ARGS[@]}"
    say "switch.py $name: rc $?"
    $PY benchmarks/breakdown.py "$S/results/$name" > /dev/null 2>&1
    rm -rf "$WORK_DIR/$name/relayer/run/checkpoints"
}

step7b() {
    $PY benchmarks/step_cost.py --shape "$(shape 7b)" --out "$S/results/step7b" --profile
    say "step_cost.py: rc $?"
}

# The step of deepspeed.zero_stage = 0 (relayer's MasterAdamW) beside the peer's and ZeRO-2's, then 7B
# switches at stage 0: 13 phases as lisa7b, and 5 more with the switch and the first steps profiled
# (RELAYER_PROFILE_SWITCH, RELAYER_PROFILE_STEPS: the phases' *-profile-rank0.txt; slower, not timed).
diag0() {
    $PY benchmarks/step_cost.py --shape "$(shape 7b)" --out "$S/results/step7b-zero0" \
        --ways fwd-bwd,torch-bf16-fused,ds-zero2-fused,ds-zero0-relayer
    say "step_cost.py: rc $?"
    lisa7b0
    space 7b --layers lisa --phases 5 --handover || exit 3
    RELAYER_PROFILE_SWITCH=1 RELAYER_PROFILE_STEPS=1 switch lisa7b-zero0-profiled 7b --phases 5 --steps 20 \
        --zero-stage 0 --timeout 200
    mkdir -p "$S/results/lisa7b-zero0-profiled/profiles"
    (cd "$WORK_DIR/lisa7b-zero0-profiled/relayer/run/phases" && for f in */*-profile-rank0.txt; do
        cp "$f" "$S/results/lisa7b-zero0-profiled/profiles/${f%%/*}-${f##*/}"; done) 2>/dev/null
    rm -rf "$WORK_DIR/lisa7b-zero0-profiled"
}

lisa7b0() {  # keep_last 1: with 2 the plan's peak (every layer trained, twice) is more than the 64 GB disk
    space 7b --layers lisa --phases 13 --handover || exit 3
    switch lisa7b-zero0 7b --phases 13 --steps 20 --zero-stage 0 --keep-last 1 --timeout 400
    rm -rf "$WORK_DIR/lisa7b-zero0"
}

# Stage 0 whole (one machine start), the whole job first: peer7b0, the kernel's test on the GPU and the
# step way by way (step0), lisa7b0 (the model peer7b0 made in /dev/shm reused).
stage0() {
    peer7b0
    step0
    lisa7b0
}

step0() {  # the kernel's test on the GPU, and one steady step at stage 0 (kernel and torch) beside the peer's
    $PY -m pytest -q -p no:cacheprovider tests/launch/test_master_adamw.py tests/launch/test_staging.py 2>&1 | tail -3
    $PY benchmarks/step_cost.py --shape "$(shape 7b)" --out "$S/results/step7b-zero0" \
        --ways fwd-bwd,torch-bf16-fused,ds-zero0-relayer-torch,ds-zero0-relayer
    say "step_cost.py: rc $?"
}

# peer7be with relayer at deepspeed.zero_stage = 0 (its own AdamW over fp32 masters, no ZeRO).
peer7b0() { peer 7b peer7b-zero0 --every-seconds 0 --zero-stage 0; }

lisa7b() {
    space 7b --layers lisa --phases 13 --handover || exit 3
    switch lisa7b 7b --phases 13 --steps 20 --timeout 400
    rm -rf "$WORK_DIR/lisa7b"
}

# big_run NAME SHAPE PHASES STEPS TIMEOUT: relayer alone at a big shape, with the micro batch and the
# pre-warming _space.py found to fit (pre-warming off where no pre-warmed phase fits the host).
big_run() {
    space "$2" --layers lisa --phases "$3" --handover || exit 3
    local depth=()
    [ "$DEPTH" -lt 3 ] && depth=(--prewarm-depth "$DEPTH")
    [ "$DEPTH" = 0 ] && depth=(--prewarm off)
    switch "$1" "$2" --phases "$3" --steps "$4" --micro-batch "$MICRO" "${depth[@]}" --timeout "$5"
}

big13() {
    rm -rf "$SHM/model-7b"
    big_run big13 13b 8 20 300
    rm -rf "$WORK_DIR/big13" "$SHM/model-13b"
}

big30() {
    rm -rf "$SHM/model-7b" "$SHM/model-13b"
    big_run big30 30b 4 5 420
    local sched="$WORK_DIR/big30/relayer/schedule.toml"
    if [ -f "$sched" ]; then  # what the plan decides with pre-warming on: every switch through the checkpoint
        sed -e 's/^prewarm = false/prewarm = true/' "$sched" > "$S/results/big30/schedule-prewarm-on.toml"
        $PY -c "from orchestrator.cli import main; main()" plan "$S/results/big30/schedule-prewarm-on.toml" \
            --device-memory "$DEVICE_BYTES" > "$S/results/big30/plan-prewarm-on.txt" 2>&1
    fi
    rm -rf "$WORK_DIR/big30" "$SHM/model-30b"
}

# Issue #23's long runs (checkpoint.every_seconds), each one device command:
#   long11  ~8 min  1.1B, 200 LISA phases x 20 steps at the default cadence (300 s): the run shorter
#                   than 300 s of training writes few checkpoints, each of every layer trained since.
#   long11e ~9 min  long11 with every_seconds = 0: a 1.93 GB checkpoint at every phase end (~1.1 GB/s).
#   long7   ~8 min  7B, 60 LISA phases x 20 steps at the default cadence (keep_last 1), then 16 phases with
#                   every_seconds = 0 (a checkpoint at every phase end), for the switches beside it.
long11() {
    space 1.1b --layers lisa --phases 200 --handover --carried 2 || exit 3
    switch long11 1.1b --phases 200 --steps 20 --timeout 540
    rm -rf "$WORK_DIR/long11"
}

long11s() {  # 50 phases of long11: the carried layers' take, within the last few minutes of a session
    space 1.1b --layers lisa --phases 50 --handover --carried 2 || exit 3
    switch long11s 1.1b --phases 50 --steps 20 --timeout 200
    rm -rf "$WORK_DIR/long11s"
}

long11e() {  # long11 with every_seconds = 0 (a checkpoint at every phase end): the switches beside it
    space 1.1b --layers lisa --phases 200 --handover || exit 3
    switch long11-every-phase 1.1b --phases 200 --steps 20 --every-seconds 0 --timeout 560
    rm -rf "$WORK_DIR/long11-every-phase"
}

long7() {
    long7c
    switch long7-every-phase 7b --phases 16 --steps 20 --every-seconds 0 --timeout 180
    rm -rf "$WORK_DIR/long7-every-phase"
}

long7c() {
    # keep_last 1: a checkpoint of every layer is 29 GB at 7B, and the plan counts two of them (the
    # kept one and the next) and one more copy of each layer: 86 GB, which /dev/shm holds, the disk not.
    space 7b --layers lisa --phases 60 --handover --carried 2 || exit 3
    switch long7 7b --phases 60 --steps 20 --keep-last 1 --timeout 330
    rm -rf "$WORK_DIR/long7"
}

# Issue #41's measurement on an H100, one device command (~8 min): the GPU tests of the optimizer's
# kernel and of the carried layers' host path; the peer job at relayer's defaults (no zero_stage,
# cadence or handover key; 260 steps: 13 phases), beside the peer; 1.1B under LISA at the default
# cadence (20 phases, handed over on the device), where the carried layers wait on the host.
issue41() {
    $PY -m pytest -q -p no:cacheprovider tests/launch/test_master_adamw.py tests/launch/test_carried.py \
        tests/launch/test_staging.py 2>&1 | tail -3
    defaults7b peer7b-defaults 13
    space 1.1b --layers lisa --phases 20 --handover --carried 2 || exit 3
    switch cadence11 1.1b --phases 20 --steps 20 --zero-stage 0 --timeout 150
    rm -rf "$WORK_DIR/cadence11"
}

# Issue #41 with one copy of the model per GPU (launch.resident, the default on a GPU): the peer job at
# relayer's defaults (7B, 260 steps, 14 LISA phases: no zero_stage, cadence or handover key), side by side.
resident7b() { defaults7b resident7b-defaults 14; }

# defaults7b NAME PHASES: the peer job at relayer's defaults (7B, 260 steps; PHASES sizes the disk), its
# run removed after.
defaults7b() {
    space 7b --layers lisa --phases "$2" --final-model --peer-output --handover || exit 3
    timeout 480 $PY benchmarks/peer.py --shape "$(shape 7b)" --model-dir "$MODEL_DIR" --outputs "$WORK_DIR" \
        --work "$S/work/$1" --micro-batch "$MICRO" --results-dir "$S/results" --out "$1" \
        --timeout 450 --callback auto --keep-last 1 --steps 260 "${TINY_ARGS[@]}"
    say "peer.py $1: rc $?"
    rm -rf "$S/work/$1" "$WORK_DIR" "$SHM/model-7b"
}

# The carried layers on the host alone (issue41's second half): 1.1B, 20 LISA phases at the default cadence.
cadence11() {
    space 1.1b --layers lisa --phases 20 --handover --carried 2 || exit 3
    switch cadence11 1.1b --phases 20 --steps 20 --zero-stage 0 --timeout 150
    rm -rf "$WORK_DIR/cadence11"
}

case "$STEP" in
    issue41) issue41 ;;
    resident7b) resident7b ;;
    cadence11) cadence11 ;;
    peer7b) peer7b ;;
    peer7be) peer7be ;;
    lisa7b) lisa7b ;;
    step7b) step7b ;;
    diag0) diag0 ;;
    stage0) stage0 ;;
    step0) step0 ;;
    lisa7b0) lisa7b0 ;;
    peer7b0) peer7b0 ;;
    big13) big13 ;;
    big30) big30 ;;
    big) big13; big30 ;;
    lisa13) lisa7b; big13 ;;  # one machine start for both (~7 min)
    long11) long11 ;;
    long11s) long11s ;;
    long11e) long11e ;;
    long7) long7 ;;
    long7c) long7c ;;  # the cadence run alone
    *) say "unknown step $STEP (peer7b, peer7be, peer7b0, lisa7b, lisa7b0, step7b, diag0, stage0, step0, lisa13, big, big13, big30, long11, long11s, long11e, long7, long7c)"; exit 2 ;;
esac
