"""Fixtures shared by test files: the profiles of the two long reference models, made once
per session in one cache directory (``test_profile.py`` and ``test_budget.py`` use them)."""

from __future__ import annotations

import pytest
import torch

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
