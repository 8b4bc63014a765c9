"""Issue #41's experiment: how can one copy of the frozen weights live on a GPU for a whole run while
phase processes come and go? Two ways, each in both of torch's IPC modes (plain cudaIpc handles, and
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: cuMem memory shared as file descriptors), with
the processes siblings as phases are (children of one parent, none a child of another) and with the
project's recipe (``launch/handover.py``: ``_share_cuda_`` fields in JSON, ``_new_shared_cuda``):

- chain: A allocates and exports; B maps A's block and exports what it mapped again; A exits; C maps
  B's export; B exits; C reads. (Phases that adopt the block and offer it on.)
- owner: O allocates and exports once; P1 maps O's handle, writes into the block in place and exits;
  P2 and P3 map O's same handle at once; P2 sees P1's write; O is SIGKILLed while P3 holds its
  mapping; P3 reads again. (A long-lived owner spawned with the run; phases map it.)

NVML's used memory is recorded at each point. Prints one JSON line per mode; ``--out`` writes them.

    python benchmarks/resident_probe.py --gb 1 --out probe.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FIELDS = ("device", "handle", "size", "offset", "rc_handle", "rc_offset", "event", "event_sync")


def _used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else -1


def _export(t, path: Path) -> None:
    import torch

    torch.cuda.synchronize()
    fields = t.untyped_storage()._share_cuda_()
    doc = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in zip(FIELDS, fields)}
    doc["numel"] = t.numel()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(path)


def _map(path: Path):
    import torch

    f = json.loads(path.read_text())
    numel = f.pop("numel")
    f = {k: base64.b64decode(v) if isinstance(v, str) else v for k, v in f.items()}
    t0 = time.perf_counter()
    s = torch.UntypedStorage._new_shared_cuda(0, f["handle"], f["size"], f["offset"], f["rc_handle"], f["rc_offset"],
                                              f["event"], f["event_sync"])
    t = torch.empty(0, dtype=torch.float32, device="cuda").set_(s, 0, (numel,), (1,))
    torch.cuda.synchronize()
    return t, time.perf_counter() - t0


def _check(t, bump: float = 0.0) -> bool:
    import torch

    n = t.numel()
    tail = torch.arange(n - 3, n, dtype=torch.float32)
    head = torch.tensor([0.0 + bump])
    return bool(torch.equal(t[-3:].cpu(), tail) and torch.equal(t[:1].cpu(), head))


def _wait(path: Path, limit: float = 90.0) -> bool:
    end = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _say(d: Path, name: str, **facts) -> None:
    tmp = d / f"{name}.facts.tmp"
    tmp.write_text(json.dumps(facts))
    tmp.rename(d / f"{name}.facts")


def role(argv: list[str]) -> None:
    """One process of the experiment: alloc | reexport | read | write."""
    import torch

    what, d, name = argv[0], Path(argv[1]), argv[2]
    torch.cuda.set_device(0)
    facts: dict = {"pid": os.getpid()}
    try:
        if what == "alloc":
            n = int(float(argv[3]) * 2**30) // 4
            t = torch.arange(n, dtype=torch.float32, device="cuda")
            _export(t, d / f"{name}.json")
        else:
            t, facts["map_seconds"] = _map(d / f"{argv[3]}.json")
            facts["ok"] = _check(t, float(argv[4]) if len(argv) > 4 else 0.0)
            if what == "write":
                t[0] += 1.0
                torch.cuda.synchronize()
            if what == "reexport":
                try:
                    _export(t, d / f"{name}.json")
                    facts["reexported"] = True
                except Exception as e:  # noqa: BLE001 - the experiment reports what happened
                    facts["reexport_error"] = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001
        facts["error"] = f"{type(e).__name__}: {e}"[:300]
    _say(d, name, **facts)
    if what != "alloc" and "error" not in facts:  # read again once told (after others exited)
        if _wait(d / f"{name}.again", 120):
            try:
                facts["again_ok"] = _check(t, float(argv[4]) if len(argv) > 4 else 0.0)
            except Exception as e:  # noqa: BLE001
                facts["again_error"] = f"{type(e).__name__}: {e}"[:300]
            (d / f"{name}.facts").unlink(missing_ok=True)
            _say(d, name, **facts)
    _wait(d / f"{name}.release", 180)
    os._exit(0)


class Run:
    def __init__(self, d: Path, env: dict):
        self.d, self.env, self.procs = d, env, {}

    def start(self, what: str, name: str, *args: str) -> None:
        self.procs[name] = subprocess.Popen([sys.executable, __file__, "--role", what, str(self.d), name, *args],
                                            env=self.env)

    def facts(self, name: str, limit: float = 90.0) -> dict:
        p = self.d / f"{name}.facts"
        if not _wait(p, limit):
            return {"no_answer": True}
        return json.loads(p.read_text())

    def again(self, name: str) -> dict:
        (self.d / f"{name}.facts").unlink()
        (self.d / f"{name}.again").touch()
        return self.facts(name)

    def end(self, name: str) -> int | None:
        (self.d / f"{name}.release").touch()
        try:
            return self.procs[name].wait(30)
        except subprocess.TimeoutExpired:
            self.procs[name].kill()
            return None


def chain(run: Run, gb: float) -> dict:
    r: dict = {"used_mib_start": _used_mib()}
    run.start("alloc", "A", str(gb))
    r["A"] = run.facts("A")
    run.start("reexport", "B", "A")
    r["B"] = run.facts("B")
    r["A_exit"] = run.end("A")
    time.sleep(1)
    r["used_mib_A_gone"] = _used_mib()
    if r["B"].get("reexported"):
        run.start("read", "C", "B")
        r["C"] = run.facts("C")
        r["B_exit"] = run.end("B")
        time.sleep(1)
        r["C_after_B_exit"] = run.again("C")
        r["used_mib_only_C"] = _used_mib()
        run.end("C")
    else:
        run.end("B")
    time.sleep(1)
    r["used_mib_end"] = _used_mib()
    return r


def owner(run: Run, gb: float) -> dict:
    r: dict = {"used_mib_start": _used_mib()}
    run.start("alloc", "O", str(gb))
    r["O"] = run.facts("O")
    r["used_mib_O"] = _used_mib()
    run.start("write", "P1", "O")
    r["P1"] = run.facts("P1")
    r["P1_exit"] = run.end("P1")
    run.start("read", "P2", "O", "1")
    run.start("read", "P3", "O", "1")
    r["P2"], r["P3"] = run.facts("P2"), run.facts("P3")
    r["used_mib_O_P2_P3"] = _used_mib()
    r["P2_exit"] = run.end("P2")
    run.procs["O"].send_signal(signal.SIGKILL)
    run.procs["O"].wait(30)
    time.sleep(1)
    r["P3_after_owner_killed"] = run.again("P3")
    r["used_mib_only_P3"] = _used_mib()
    run.end("P3")
    time.sleep(1)
    r["used_mib_end"] = _used_mib()
    return r


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        role(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/resident-probe"))
    a = ap.parse_args()
    results = []
    for mode, conf in (("cudaIpc", None), ("expandable_segments", "expandable_segments:True")):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        for way in (chain, owner):
            d = a.dir / f"{mode}-{way.__name__}"
            d.mkdir(parents=True, exist_ok=True)
            run = Run(d, env)
            try:
                r = {"mode": mode, "way": way.__name__, **way(run, a.gb)}
            except Exception as e:  # noqa: BLE001
                r = {"mode": mode, "way": way.__name__, "driver_error": f"{type(e).__name__}: {e}"[:300]}
            for p in run.procs.values():
                if p.poll() is None:
                    p.kill()
            print(json.dumps(r), flush=True)
            results.append(r)
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
