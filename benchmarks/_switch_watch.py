"""What ``switch.py`` watches from outside the run while it goes: the devices (NVML) and the host
memory of relayer's phase processes (psutil). Nothing here touches CUDA, so this process holds no
device context that would count in what it measures.

- ``Devices``: the NVML handles of the GPUs a run uses (``CUDA_VISIBLE_DEVICES`` respected, since
  NVML numbers the devices physically and two runs may share one machine, one GPU each).
- ``JournalWatch``: the devices sampled as soon as the journal says a phase's processes are gone.
- ``DeviceTrace``: the fullest device's used memory every 20 ms, for the overlap's peak at each switch.
- ``HostWatch``: the USS of every rank of every phase every 0.2 s, for a waiting phase's host memory.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psutil

from shard_tools.errors import CheckpointError
from shard_tools.store import Checkpoints


class Devices:
    """The NVML handles of the first ``count`` GPUs this process's children will see."""

    def __init__(self, nv, count: int):
        self.nv = nv
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
        handles = []
        # Fewer visible than asked (a --prepare-only run on one GPU): those there are.
        for i in range(count if names is None else min(count, len(names))):
            if names is None:
                handles.append(nv.nvmlDeviceGetHandleByIndex(i))
            elif names[i].isdigit():
                handles.append(nv.nvmlDeviceGetHandleByIndex(int(names[i])))
            else:
                handles.append(nv.nvmlDeviceGetHandleByUUID(names[i].encode()))  # a C string in pynvml
        self.handles = handles

    def used(self) -> list[int]:
        return [self.nv.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]

    def describe(self) -> list[dict]:
        out = []
        for h in self.handles:
            name, uuid = self.nv.nvmlDeviceGetName(h), self.nv.nvmlDeviceGetUUID(h)
            out.append({"name": name.decode() if isinstance(name, bytes) else name,
                        "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                        "index": self.nv.nvmlDeviceGetIndex(h),
                        "memory_total": self.nv.nvmlDeviceGetMemoryInfo(h).total})
        return out

    def sample(self, note: dict) -> dict:
        """Memory used on the run's devices (summed; each in ``per_device``) and who uses it."""
        procs = [{"pid": p.pid, "used": p.usedGpuMemory}
                 for h in self.handles for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h)]
        per = self.used()
        return {"time": time.time(), "used": sum(per), "per_device": per, "processes": procs, **note}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def phase_pids(phase_dir: Path, prefix: str = "") -> list[int]:
    # The local launcher execs the worker, so "launcher" and "rank-0" can name the same pid.
    pids = set()
    for p in (phase_dir / "pids").glob(f"{prefix}*.json"):
        try:
            pids.add(json.loads(p.read_text())["pid"])
        except (OSError, ValueError):  # the phase's folder pruned (KEEP_PHASE_DIRS) or being written
            continue
    return sorted(pids)


def leftovers(sample: dict, pids: list[int]) -> list[dict]:
    return [p for p in sample["processes"] if p["pid"] in pids]


class _Poller(threading.Thread):
    """A daemon thread calling ``look`` every ``interval`` seconds until ``stop`` is set."""

    interval = 0.02

    def __init__(self, name: str):
        super().__init__(daemon=True, name=name)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.look()
            time.sleep(self.interval)
        self.look()

    def look(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        self.stop.set()
        self.join()


class JournalWatch(_Poller):
    """Samples the devices as soon as the journal says a phase's processes are all gone.

    The orchestrator journals phase_done only after reaping the phase; the next phase needs
    seconds of imports before it makes a CUDA context, so a 20 ms poll lands in that gap.
    """

    def __init__(self, devices: Devices, run_dir: Path):
        super().__init__("journal-watch")
        self.devices, self.run_dir, self.samples, self.offset = devices, run_dir, [], 0

    def look(self) -> None:
        journal = self.run_dir / "journal.jsonl"
        if not journal.exists():
            return
        with open(journal) as f:
            f.seek(self.offset)
            chunk = f.read()
        done = chunk.rfind("\n") + 1
        self.offset += len(chunk[:done].encode())
        for line in chunk[:done].splitlines():
            e = json.loads(line)
            if e["event"] == "phase_done":
                s = self.devices.sample({"after_phase": e["phase"]})
                s["phase_pids"] = phase_pids(self.run_dir / "phases" / f"phase-{e['phase']:04d}")
                self.samples.append(s)


class DeviceTrace(_Poller):
    """The used memory (NVML) of the run's fullest device every 20 ms: (time, bytes). The fullest,
    not the sum: the plan's overlap estimate is for one device, as what must fit is."""

    def __init__(self, devices: Devices):
        super().__init__("device-trace")
        self.devices, self.trace = devices, []

    def look(self) -> None:
        self.trace.append((time.time(), max(self.devices.used())))

    def peak(self, t0: float, t1: float) -> int | None:
        inside = [u for t, u in self.trace if t0 <= t <= t1]
        return max(inside) if inside else None

    def coarse(self, seconds: float = 0.5) -> list[list[float]]:
        """The trace as the peak of each ``seconds`` bin (for the plot and results.json)."""
        bins: dict[int, int] = {}
        for t, u in self.trace:
            k = int(t / seconds)
            bins[k] = max(bins.get(k, 0), u)
        return [[round(k * seconds, 2), u] for k, u in sorted(bins.items())]


class HostWatch(_Poller):
    """The USS (pages no other process shares, ``memory_full_info``) and RSS of every rank of every phase.

    USS is what a phase holds alone: forked phases share the fork server's imported modules and
    base weights copy-on-write, so a forked phase's USS can be below a bare process's (which
    imported everything itself); its RSS counts those shared pages too. The two bound its cost."""

    interval = 0.2

    def __init__(self, run_dir: Path):
        super().__init__("host-watch")
        self.run_dir = run_dir
        self.samples: dict[int, list[tuple[float, int, int, int]]] = {}
        """Per phase: (time, rank, USS bytes, RSS bytes)."""
        self.procs: dict[tuple[int, int], psutil.Process] = {}

    def look(self) -> None:
        for pid_file in (self.run_dir / "phases").glob("phase-*/pids/rank-*.json"):
            phase, rank = int(pid_file.parent.parent.name.split("-")[1]), int(pid_file.stem.split("-")[1])
            try:
                rec = json.loads(pid_file.read_text())
                proc = self.procs.get((phase, rank))
                if proc is None or proc.pid != rec["pid"]:
                    proc = self.procs[(phase, rank)] = psutil.Process(rec["pid"])
                mem = proc.memory_full_info()
            except (OSError, ValueError, KeyError, psutil.Error):
                continue  # not written whole yet, or the process is gone
            self.samples.setdefault(phase, []).append((time.time(), rank, mem.uss, mem.rss))

    def peak(self, phase: int, t0: float, t1: float) -> dict | None:
        """The largest USS and RSS of any of the phase's ranks between t0 and t1."""
        inside = [(u, r) for t, _, u, r in self.samples.get(phase, []) if t0 <= t <= t1]
        return {"uss": max(u for u, _ in inside), "rss": max(r for _, r in inside)} if inside else None


def start_all(watchers: list[_Poller]) -> None:
    for w in watchers:
        w.start()


def finish_all(watchers: list[_Poller]) -> None:
    for w in watchers:
        w.finish()


class ManifestWatch(_Poller):
    """Each checkpoint's manifest as soon as it is there (retention removes older checkpoints
    later): its step, phase, layers, the head's and the body's Adam steps, and when it was made."""

    interval = 0.1
    KEYS = ("global_step", "phase", "layers", "carried_layers", "phase_complete", "head_step", "body_step", "created")

    def __init__(self, run_dir: Path):
        super().__init__("manifest-watch")
        self.run_dir, self.manifests = run_dir, {}

    def look(self) -> None:
        store = Checkpoints(self.run_dir)
        for ckpt in store.all():
            if ckpt.name in self.manifests or not store.committed(ckpt):
                continue
            try:
                m = store.manifest(ckpt)
            except (OSError, CheckpointError):
                continue  # a removal raced this look
            self.manifests[ckpt.name] = {**{k: getattr(m, k) for k in self.KEYS},
                                         "bytes": sum(e.size for e in m.files.values())}


class DiskWatch(_Poller):
    """The bytes under the run's checkpoints folder and under the whole run directory, every 0.5 s:
    the most each ever held."""

    interval = 0.5

    def __init__(self, run_dir: Path):
        super().__init__("disk-watch")
        self.run_dir, self.peak, self.peak_all = run_dir, 0, 0

    def look(self) -> None:
        self.peak = max(self.peak, _bytes_under(self.run_dir / "checkpoints"))
        self.peak_all = max(self.peak_all, _bytes_under(self.run_dir))


def _bytes_under(root: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(folder, f)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


class TreeMemory(_Poller):
    """Without a GPU: the RSS of every process below this one, summed, every 0.1 s: (time, bytes)."""

    interval = 0.1

    def __init__(self):
        super().__init__("tree-memory")
        self.trace: list[tuple[float, int]] = []

    def look(self) -> None:
        total = 0
        for p in psutil.Process().children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        self.trace.append((time.time(), total))


class MemInfoWatch(_Poller):
    """The host's dirty and under-writeback page cache (/proc/meminfo), every 50 ms: a finished
    phase's checkpoint on its way to the disk, which the orchestrator's own fsyncs may wait behind."""

    interval = 0.05

    def __init__(self):
        super().__init__("meminfo")
        self.trace: list[tuple[float, int, int]] = []

    def look(self) -> None:
        try:
            fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        except OSError:
            return
        kb = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024  # noqa: E731
        self.trace.append((time.time(), kb("Dirty"), kb("Writeback")))

    def at(self, t: float) -> dict | None:
        before = [s for s in self.trace if s[0] <= t]
        return {"dirty": before[-1][1], "writeback": before[-1][2]} if before else None
