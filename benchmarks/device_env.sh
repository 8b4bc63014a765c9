# Sourced at the start of a command on the lent GPU machine, from the project root, with .whl carried:
#
#     run(kind="nvidia-h200", carry=[".whl"], command=". benchmarks/device_env.sh && python3 -m pytest -m cuda tests/...")
#
# Installs the wheels (../shared/device/README.md), puts the project on PYTHONPATH, and makes the
# console scripts the tests start next to the interpreter (tests/conftest.py runs
# Path(sys.executable).parent / "orchestrator"), since the project itself is not pip-installed there.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} PYTHONUNBUFFERED=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID
_bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
printf '#!/bin/sh\nexec %s -m orchestrator "$@"\n' "$_bin/python3" > "$_bin/orchestrator"
printf '#!/bin/sh\nexec %s -c "from shard_tools.cli import main; main()" "$@"\n' "$_bin/python3" > "$_bin/shard-tools"
chmod +x "$_bin/orchestrator" "$_bin/shard-tools"
unset _bin
