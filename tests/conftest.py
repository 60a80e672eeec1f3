"""Fixtures shared by test files: the profiles of the two long reference models, made once
per session in one cache directory (``test_profile.py`` and ``test_budget.py`` use them); a
one-rank gloo process group and its CPU device meshes, for the single-process DTensor, TP and
FSDP2 tests (the multi-rank ones launch ranks through ``twoproc``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from actplan.models import load_model
from actplan.planning.cache import get_profile

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


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group for the test (torch's in-memory store; cheap to set up):
    one already initialized is used as it is, and left up."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank_mesh(one_rank_group):
    """A 1-D CPU device mesh of the one rank, its dimension unnamed."""
    return init_device_mesh("cpu", (1,))


@pytest.fixture
def tp_mesh(one_rank_group):
    """A 1-D CPU device mesh of the one rank, its dimension named ``tp``."""
    return init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
