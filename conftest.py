"""For every test folder (``tests/``, ``bench/tests/``): under pytest-xdist (``make test`` runs
``-n auto``) each worker gives torch its share of the cores, and so do the processes the tests
start (torchrun ranks, CLI runs). Two workers of two threads each on two cores wait on each
other and run slower than one worker alone. For the same reason an ``actplan estimate`` the
tests run steps its presets in its own process (``ACTPLAN_WORKERS=1``) unless a test asks for
worker processes.

pytest-xdist's workers run with ``COLUMNS=80``; a plain ``pytest`` run has whatever the shell
exported. The command line honours ``COLUMNS``, so the tests drop it: they read the tables a
user piping the output sees (100 columns), the same with and without ``-n``."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("ACTPLAN_WORKERS", "1")
os.environ.pop("COLUMNS", None)

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
