"""Fixtures shared by test files: the profiles of the two long reference models, made once
per session in one cache directory (``test_profile.py`` and ``test_budget.py`` use them).

Under pytest-xdist (``make test`` runs ``-n auto``) each worker gets its share of the cores for
torch's threads, and so do the processes the tests start (torchrun ranks, CLI runs): two workers
of two threads each on two cores spin-wait on each other and run slower than one."""

from __future__ import annotations

import os

import pytest
import torch

from actplan.models import load_model
from actplan.planning.cache import get_profile

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="session")
def dense(cache):
    bundle = load_model("model_factories:dense_long")
    profile, _ = get_profile(
        bundle, "model_factories:dense_long", CPU, cache_dir=cache, repeats=3, min_bytes=0
    )
    return bundle, profile


@pytest.fixture(scope="session")
def moe(cache):
    bundle = load_model("model_factories:moe_long")
    profile, _ = get_profile(bundle, "model_factories:moe_long", CPU, cache_dir=cache, repeats=3, min_bytes=0)
    return bundle, profile
