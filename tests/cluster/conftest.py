"""The SLURM cluster of this session (``tests/cluster/slurm.py``): installed where it is missing and
this is root with apt-get, started once, stopped at the end with every process it started.
Where it cannot be, the tests that need it skip, saying why."""

from __future__ import annotations

import sys

import pytest

from tests.cluster.slurm import Cluster, install


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    if not sys.platform.startswith("linux"):
        pytest.skip("a SLURM cluster on this machine needs Linux")
    reason = install()
    if reason:
        pytest.skip(f"no SLURM cluster on this machine: {reason}")
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
