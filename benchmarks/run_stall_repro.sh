#!/bin/bash
# Issue #24's 7B stall, reproduced with a 1.1B model on the lent H200, in ONE device command of at
# most 8 minutes (benchmarks/stall_repro.py says what it does and why 1.1B reproduces the 7B case).
# From the project root, after ../shared/device/make-wheels.sh has filled .whl/ (py-spy included):
#
#     run(kind="nvidia-h200", carry=[".whl"], timeout_s=480, command="bash benchmarks/run_stall_repro.sh")
#
# ~15 s wheels, ~40 s the 1.1B model, then the run: 4 phases x 10 steps, handover auto, every
# checkpoint kept on a disk left with room for 1.5 end checkpoints (fallocate), so that phase 1's
# handed-over write meets a full disk. Looks at 20 s and 60 s of no progress; the watchdog
# (launch.stall_seconds 20: 80 s for a handed-over write) should end the run with exit 1; SIGTERM
# if it has not; at most 420 s in all. $OUT: log.txt, orchestrator.log, result.json, looks/*/ (state, wchan,
# /proc/PID/stack, py-spy --native of every process; journal, worker logs, stacks), final/.
# Extra arguments go to stall_repro.py (e.g. --fill tmpfs). On a CPU, for trying it:
#     OUT=/tmp/o DS_ACCELERATOR=cpu bash benchmarks/run_stall_repro.sh --shape tiny --fill none --stall-write --stall-seconds 3 --looks 3
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
exec > >(tee "$OUT/log.txt") 2>&1
if [ -d .whl ]; then
    . benchmarks/device_env.sh || exit 1
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null
df -h /tmp | tail -1; nproc; command -v py-spy || echo "no py-spy: Python stacks from the watchdog's files only"
python3 benchmarks/stall_repro.py "$@"
rc=$?
rm -f /tmp/stall-repro/filler  # the disk back, whatever happened
umount /tmp/stall-repro/fs 2>/dev/null
exit $rc
