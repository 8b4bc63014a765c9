"""A real SLURM cluster of two nodes on this machine: Debian's slurm-wlm, one controller and two
slurmd daemons (n1, n2, each its own node), and a munged of its own, all in one state directory
under /tmp. The node names do not resolve (as on many sites); their NodeAddr is 127.0.0.1.

    .venv/bin/python tests/cluster/slurm.py install   # apt-get install slurm-wlm munge where missing (root)
    .venv/bin/python tests/cluster/slurm.py try       # start the cluster, run a task on each node, stop it

Both nodes share the machine's CPUs and file system: this proves launching, signals, requeue and
resharding across nodes, not bandwidth. Every daemon and job process carries MARKER=<state dir>
in its environment, so that ``stop`` leaves none of them behind.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

PACKAGES = ["slurm-wlm", "munge"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue"]
NODES = ["n1", "n2"]
CPUS = 2
"""Per node: both nodes share this machine's cores (each job takes one or two of them)."""
MARKER = "RELAYER_TEST_SLURM"

CONF = """\
ClusterName=relayer-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=600
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
NODE = "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=4000"


def missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def install(timeout: float = 900) -> str | None:
    """Installs slurm-wlm and munge where they are missing; the reason where they cannot be (None: installed)."""
    if not missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(missing())} missing) and this is not root with apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Without the recommended plugins (HDF5, ROCm, InfluxDB, ...): the basic ones are all this cluster uses.
    add = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    steps = [add, ["apt-get", "update"], add]
    for argv in steps:  # a stale package list is the usual reason the first install fails
        try:
            r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"{shlex.join(argv)} took over {timeout:g} s"
        if r.returncode == 0 and not missing():
            return None
        last = (r.stderr or r.stdout).strip().splitlines()[-1:]
    return f"could not install {' '.join(PACKAGES)}: {' '.join(last)}"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Cluster:
    """The cluster in its state directory: ``start``, then the clients with ``env``, then ``stop``."""

    def __init__(self, root: Path | None = None):
        self.root = root or Path(tempfile.mkdtemp(prefix="relayer-slurm-", dir="/tmp"))
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), MARKER: str(self.root)}
        """The environment of the clients (sbatch, srun, scontrol), inherited by every job."""
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_")) and v != "SLURM_CONF"]:
            del self.env[var]  # an outer job's variables would steer this cluster's clients

    def start(self, timeout: float = 60) -> None:
        self.root.chmod(0o755)  # munged wants its socket's folder searchable by all
        for sub in ("state", "spool", "log", "munge", "key"):
            (self.root / sub).mkdir(exist_ok=True)
        (self.root / "key").chmod(0o700)
        self._write_conf()
        self._start_munge()
        self._daemon(["slurmctld", "-f", str(self.conf)])
        for name in NODES:
            self._daemon(["slurmd", "-f", str(self.conf), "-N", name])
        self._wait_idle(timeout)

    def _write_conf(self) -> None:
        ctld, slurmd, *node_ports = free_ports(2 + len(NODES))
        nodes = "\n".join(NODE.format(name=n, port=p, cpus=CPUS) for n, p in zip(NODES, node_ports))
        self.conf.write_text(CONF.format(root=self.root, ctld_port=ctld, slurmd_port=slurmd, nodes=nodes,
                                         names=",".join(NODES)))

    def _start_munge(self) -> None:
        key = self.root / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        m = self.root / "munge"
        self._daemon(["munged", f"--socket={m}/munge.socket", f"--key-file={key}", f"--pid-file={m}/munged.pid",
                      f"--log-file={self.root}/key/munged.log", f"--seed-file={self.root}/key/munged.seed"])

    def _daemon(self, argv: list[str]) -> None:
        """Starts a daemon that forks into the background; its start-up errors are the message."""
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=60, cwd=self.root)
        if r.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {r.returncode}: {r.stderr.strip()}\n{self.logs()}")

    def _wait_idle(self, timeout: float) -> None:
        end = time.time() + timeout
        while time.time() < end:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the nodes did not come up within {timeout:g} s\n{self.logs()}")

    def run(self, *argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        r = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Submits a batch job; returns its id."""
        r = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                           env={**self.env, **(env or {})})
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {shlex.join(args)} exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """The job's fields once its state is one of ``states``."""
        end = time.time() + timeout
        while (job := self.job(job_id))["JobState"] not in states:
            if time.time() > end:
                raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout:g} s, not {states}\n"
                                     f"{self.logs()}")
            time.sleep(0.5)
        return job

    def logs(self, lines: int = 15) -> str:
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancels every job, ends every daemon, and every process that came from them; removes the state."""
        if self.conf.exists():
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL if p.name() != "munged" else signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=20)
        for p in alive:
            p.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: the daemons (by their pid files) and whatever carries MARKER."""
        out = {}
        for pid_file in [*self.root.glob("*.pid"), self.root / "munge" / "munged.pid"]:
            try:
                p = psutil.Process(int(pid_file.read_text()))
                out[p.pid] = p
            except (OSError, ValueError, psutil.NoSuchProcess):
                continue
        mark = f"{MARKER}={self.root}\0".encode()
        for p in psutil.process_iter():
            try:  # read raw: slurmstepd retitles itself over its environment, which psutil then misreads
                if mark in Path(f"/proc/{p.pid}/environ").read_bytes():
                    out[p.pid] = p
            except OSError:
                continue
        out.pop(os.getpid(), None)
        return list(out.values())


def _try() -> None:
    cluster = Cluster()
    try:
        cluster.start()
        print(cluster.run("srun", "-N", "2", "-n", "2", "bash", "-c", "echo $SLURMD_NODENAME $SLURM_PROCID").stdout)
    finally:
        cluster.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        reason = install()
        print(reason or "slurm-wlm and munge are installed")
        sys.exit(1 if reason else 0)
    if sys.argv[1:] == ["try"]:
        _try()
        sys.exit(0)
    sys.exit(__doc__)
