#!/bin/bash
# Issue #42's device steps: relayer's whole run held to a device budget of 24 GiB on an H100
# (launch.device_memory), beside the peer (the Hugging Face Trainer with axolotl's LISA callback)
# held to the same bytes by torch.cuda.set_per_process_memory_fraction. From the project root, once
# ../shared/device/make-wheels.sh and benchmarks/peer-wheels.sh have filled .whl/ (as run_issue29.sh):
#
#     run(kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue42.sh plan24")
#     run(kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue42.sh host1b")
#     run(kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue42.sh relayer7b24")
#     run(kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue42.sh peer7b24")
#
# Run on an H100 on 2026-12-06 (benchmarks/results/2026-12-06-issue42-h100-cap/README.md): host1b took
# 2 min; peer7b24 (micro batch 1, every_seconds 0) ran relayer to step 160 of 200 before peer.py's 420 s
# (the peer first takes ~110 s to fail): 7B at 24 GiB needs about 9 minutes, more than one command with
# the peer before it.
#
#   plan24    ~1 min  `orchestrator plan --device-memory 24GiB` of the 7B LISA job (batch 4 x 512, 2 layers
#                     every 20 steps, bf16, ZeRO 0) as it is, with gradient checkpointing, with micro
#                     batch 1 too, and with prewarm_depth 1 too: each plan's table, its switches and, where
#                     a phase is above the budget, its exit 2 naming what would fit. No GPU needed (on
#                     this project's CPU machine, 2026-12-06: all four exit 2; the first names gradient
#                     checkpointing, ZeRO 2 with offload_optimizer and prewarm_depth 1 as fitting, 23.0 GiB).
#   host1b    ~3 min  benchmarks/switch.py at 1.1B, 10 phases x 20 steps, LISA's layers, launch.device_memory
#                     24GiB and launch.handover = "host": every switch through host memory (the
#                     predecessor's fp32 state in /dev/shm, its engine's memory let go); NVML every 20 ms
#                     (the device's used bytes, every process of the run) against 24 GiB; the switch
#                     median; records.json's device_released per phase.
#   relayer7b24 ~4.5 min  relayer alone (peer.py --skip-peer: LISA's phases drawn there, the results say the
#                     peer was not run) with peer7b24's options but micro batch 4 (I42_MICRO; gradient
#                     checkpointing, in effect since it was fixed, keeps it small), 200 steps (I42_STEPS), ended at I42_DEADLINE
#                     seconds after the script's start (570) finished or not: results.json keeps how far it
#                     got, its NVML trace, each phase's records, and logs/ the run's journal, steps, records and
#                     worker logs. I42_PROFILE=1 also times benchmarks/host_step.py (the host optimizer's
#                     step and the gradients' copies, before the run) and profiles each phase's first two
#                     steps (torch.profiler) and its switch (cProfile) into logs/. On an H100 on 2026-12-06
#                     (benchmarks/results/2026-12-06-issue42-h100-7b): 255 s in all, relayer 220 s, at
#                     micro batch 1 (profiled) 533 s.
#   peer7b24  ~9 min  benchmarks/peer.py at 7B, 200 steps, batch 4 x 512, --device-memory 24GiB
#                     --gradient-checkpointing --zero-stage 2 --offload-optimizer --prewarm-depth 1
#                     --micro-batch 1 --every-seconds 0 (plan24's first plan named micro batch 4 as
#                     fitting, 23.0 GiB; on the H100 it ran out of memory in phase 0, and micro batch
#                     1 under the cadence in phase 2, the carried layers on the device): the peer under the fraction
#                     (finished or not), then relayer (its plan refuses it, exit 2, where its estimate is
#                     above the budget: said in the log). The optimizer's step on the host is torch's
#                     AdamW over 0.67 B parameters: seconds a step, not measured yet.
#
# $OUT gets STEP.log, results-STEP.tgz (results.json, table.md, the plan texts, journals and records;
# no checkpoints) and, per run, the NVML peak beside the budget (budget.txt).
# On a CPU, for trying the script itself: OUT=/tmp/o DS_ACCELERATOR=cpu I42_TINY=1 bash benchmarks/run_issue42.sh host1b
set -uo pipefail
STEP=${1:?usage: run_issue42.sh plan24|host1b|relayer7b24|peer7b24}
: "${OUT:?set OUT to the folder the results go to}"
T0=$(date +%s)
S=${I42_SCRATCH:-/tmp/i42}
SHM=${I42_SHM:-/dev/shm/i42}
BUDGET=${I42_BUDGET:-24GiB}
mkdir -p "$S/results" "$SHM"
exec > >(tee "$OUT/$STEP.log") 2>&1
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} PYTHONUNBUFFERED=1
say() { echo "[run_issue42 $STEP $(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader 2>/dev/null
free -g | head -2; nproc
TINY=${I42_TINY:-0}
shape() { [ "$TINY" = 1 ] && echo tiny || echo "$1"; }
finish() {
    tar -czf "$OUT/results-$STEP.tgz" -C "$S" --exclude='*/checkpoints/*' --exclude='*/final/*' \
        --exclude='*.safetensors' --exclude=train.jsonl results 2>/dev/null
    say "done"
}
trap finish EXIT

# budget_check RESULTS_JSON: the NVML peak of each way beside the budget (results.json's device_peak).
budget_check() {
    $PY - "$1" "$BUDGET" <<'EOF' | tee -a "$S/results/budget.txt"
import json, sys
from shard_tools.sizes import format_bytes, parse_size
result, budget = json.load(open(sys.argv[1])), parse_size(sys.argv[2])
for name, way in result["ways"].items():
    trace = way.get("trace") or way.get("device_trace") or []  # peer.py's, switch.py's
    peak = way.get("device_peak") or max((u for _, u in trace), default=None)
    verdict = "no trace" if peak is None else ("within" if peak <= budget else "ABOVE")
    print(f"{result['name']} {name}: NVML peak {format_bytes(peak) if peak else '-'}, {verdict} {format_bytes(budget)}")
EOF
}

plan24() {
    local d="$S/results/plan24" model="$SHM/m7b-config"
    mkdir -p "$d" "$model"
    $PY - "$d" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from _shapes import SHAPES
d = Path(sys.argv[1])
shape = SHAPES["7b"]
(d / "train.jsonl").write_text("".join(json.dumps({"input_ids": list(range(1, 513))}) + "\n" for _ in range(8)))
phases = "".join(f"  {{ steps = 20, layers = [{2 * i}, {2 * i + 1}] }},\n" for i in range(10))
config = ", ".join(f"{k} = {json.dumps(v)}" for k, v in shape["model"].items() if v is not None)
(d / "schedule.toml").write_text(f"""[model]
config = {{ {config} }}
dtype = "bfloat16"
[data]
path = "train.jsonl"
seq_len = 512
batch_size = 4
micro_batch_size = 4
[deepspeed]
zero_stage = 0
[schedule]
phases = [
{phases}]
""")
EOF
    local i=0
    for sets in "" "--set model.gradient_checkpointing=true" \
            "--set model.gradient_checkpointing=true --set data.micro_batch_size=1" \
            "--set model.gradient_checkpointing=true --set data.micro_batch_size=1 --set launch.prewarm_depth=1"; do
        i=$((i + 1))
        # shellcheck disable=SC2086
        orchestrator plan "$d/schedule.toml" --device-memory "$BUDGET" $sets > "$d/plan-$i.txt" 2>&1
        say "plan $i ($sets): exit $?"; tail -4 "$d/plan-$i.txt"
    done
}

host1b() {
    local name=host1b-$BUDGET
    $PY benchmarks/switch.py --shape "$(shape 1.1b)" --ways a --layers lisa --model-dir "$SHM/m1b" --work "$S/work/$name" \
        --results-dir "$S/results" --out "$name" --handover host --device-memory "$BUDGET" --phases 10 --steps 20 \
        --timeout 400
    say "switch.py $name: rc $?"
    [ -f "$S/results/$name/results.json" ] && budget_check "$S/results/$name/results.json"
    rm -rf "$S/work/$name"
}

# relayer7b24: relayer alone (peer.py --skip-peer, LISA's phases drawn there) at 7B under the budget,
# with issue #42's options; I42_STEPS (default 200) and I42_PROFILE=1 (torch.profiler over each
# phase's first two steps, cProfile over each switch: RELAYER_PROFILE_STEPS/SWITCH) for a short look.
relayer7b24() {
    local name=relayer7b-$BUDGET steps=${I42_STEPS:-200}
    if [ "${I42_PROFILE:-0}" = 1 ]; then
        export RELAYER_PROFILE_STEPS=1 RELAYER_PROFILE_SWITCH=1
        name=$name-profile
    fi
    [ "${I42_PROFILE:-0}" = 1 ] && [ "$TINY" != 1 ] && $PY benchmarks/host_step.py --threads 16,4 --repeat 1 --out "$S/results/host_step.json"
    $PY benchmarks/peer.py --shape "$(shape 7b)" --model-dir "$SHM/m7b" --work "$S/work/$name" --results-dir "$S/results" \
        --out "$name" --device-memory "$BUDGET" --gradient-checkpointing --zero-stage 2 --offload-optimizer \
        --prewarm-depth 1 --micro-batch "${I42_MICRO:-4}" --every-seconds 0 --keep-last 1 --skip-peer --steps "$steps" \
        --deadline $((T0 + ${I42_DEADLINE:-570}))
    say "peer.py $name: rc $?"
    [ -f "$S/results/$name/results.json" ] && budget_check "$S/results/$name/results.json"
    rm -rf "$S/work/$name"
}

peer7b24() {
    local name=peer7b-$BUDGET
    $PY benchmarks/peer.py --shape "$(shape 7b)" --model-dir "$SHM/m7b" --work "$S/work/$name" --results-dir "$S/results" \
        --out "$name" --device-memory "$BUDGET" --gradient-checkpointing --zero-stage 2 --offload-optimizer \
        --prewarm-depth 1 --micro-batch 1 --every-seconds 0 --callback auto --keep-last 1 --timeout 420
    say "peer.py $name: rc $?"
    [ -f "$S/results/$name/results.json" ] && budget_check "$S/results/$name/results.json"
    rm -rf "$S/work/$name"  # peer.py kept the logs, journal, steps and records in results/$name/logs
}

case $STEP in
    plan24|host1b|relayer7b24|peer7b24) $STEP ;;
    *) say "unknown step $STEP"; exit 2 ;;
esac
