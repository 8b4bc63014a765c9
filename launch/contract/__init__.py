"""The contract between the control plane (``orchestrator/``) and the worker (``launch/``).

Torch-free: the orchestrator imports this package and nothing else of ``launch/``, and the
package imports nothing of ``launch/`` but itself (tests/orchestrator/test_boundaries.py).

- ``spec``: the phase spec, the one JSON file through which the orchestrator tells a phase what to
  do, and the learning rate of a step (both sides must agree on it);
- ``files``: the run and phase directories' files that both sides use, with their one writer and
  one reader;
- ``cadence``: whether a phase end writes its checkpoint (``checkpoint.every_seconds``), decided
  in one place for the plan, the go and the successor;
- ``dsconfig``: the DeepSpeed config relayer derives from the schedule, for the plan's checks and
  the phase's engine alike;
- ``channels``: the modules the orchestrator starts launch's processes as, and the framing of
  the two FIFOs (the fork server's requests, a pre-warmed phase's go).
"""
