#!/bin/bash
# fp16 on the lent H200: the example schedule examples/gpu/fp16.toml, preempted once with SIGTERM
# (exit 75) and resumed, then the loss scale each checkpoint carried. Run on the device from the
# project root with .whl carried; writes $OUT/fp16.log and the run's journal and metrics.
set -uo pipefail
: "${OUT:?set OUT}"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
ORCH=(python3 -c 'from orchestrator.cli import main; main()')
{
python3 examples/gpu/make_tokens.py examples/gpu/tokens.jsonl 256 512 32000
run=examples/gpu/runs/fp16
rm -rf "$run"  # a fresh run each time: the device keeps ignored outputs between calls
"${ORCH[@]}" run examples/gpu/fp16.toml & pid=$!
until [ -f $run/metrics.jsonl ] && [ "$(wc -l < $run/metrics.jsonl)" -ge 50 ]; do sleep 0.5; done
kill -TERM $pid; wait $pid; echo "after SIGTERM: exit $?"
"${ORCH[@]}" run examples/gpu/fp16.toml; echo "resumed: exit $?"
python3 - <<'PY'
import json, pathlib
from safetensors.torch import load_file
run = pathlib.Path("examples/gpu/runs/fp16")
for c in sorted((run / "checkpoints").glob("step-*")):
    m = json.loads((c / "manifest.json").read_text())
    s = load_file(str(c / "state.safetensors"))
    print(c.name, "phase", m["phase"], "head_step", m["head_step"], "loss scale", s["loss_scaler/cur_scale"].item(),
          "iter", s["loss_scaler/cur_iter"].item())
lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
print("loss first", lines[0]["loss"], "last", lines[-1]["loss"], "steps logged", len(lines))
print([e["event"] for e in map(json.loads, (run / "journal.jsonl").read_text().splitlines())])
PY
} 2>&1 | tee "$OUT/fp16.log"
cp examples/gpu/runs/fp16/journal.jsonl examples/gpu/runs/fp16/metrics.jsonl "$OUT/"
