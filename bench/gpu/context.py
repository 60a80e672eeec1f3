"""What every GPU-suite stage shares: the per-scale settings (stage caps and estimates, budget,
timing rounds, the scope cut to fit the run), the stage order, the context a stage process runs
in, deterministic algorithms for the parity steps, and the progress line on stderr."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu.models import SCALES, ModelSpec

REPO = Path(__file__).resolve().parents[2]

STAGE_ORDER = ("tests", "allocator", "offload", "bench_dense", "compiled", "plan", "bench_moe", "peers")

DEVICE_RUN_S = 600
"""One device command: at most 10 minutes, the machine's start (about 2 minutes) included."""
MACHINE_START_S = 120
SETUP_S = 45
"""Before the budget starts: ``bench/gpu/run.sh``'s set-up, the driver's imports and device check."""


@dataclass(frozen=True)
class Extra:
    """What ``--extra`` adds back: the scope cut to fit one 10-minute device run, and the seconds
    each stage's cap (and so the budget) grows by to run it."""

    caps: dict[str, float]
    compiled_presets: tuple[str, ...]
    peers_models: tuple[str, ...]


@dataclass(frozen=True)
class Settings:
    """Per scale: stage caps and planned seconds, the suite's budget, timing rounds, and what
    the stages run. ``check_settings`` holds the caps to the budget."""

    caps: dict[str, float]
    estimates: dict[str, float]
    budget_s: float
    repeats: int
    warmup: int
    offload_repeats: int
    bandwidth_bytes: int
    profile_repeats: int
    peers_models: tuple[str, ...]
    compiled_presets: tuple[str, ...]
    deselected_tests: tuple[str, ...] = ()
    """``tests/test_cuda.py`` tests the ``tests`` stage leaves out (``--extra`` runs them)."""
    extra: Extra | None = field(default=None, compare=False)


def check_settings(name: str, settings: Settings) -> None:
    """Every stage has a cap and an estimate no larger, and the caps add up to the budget at most,
    so a run where every stage needs its whole cap still reaches the last one."""
    missing = [s for s in STAGE_ORDER if s not in settings.caps or s not in settings.estimates]
    if missing:
        raise ValueError(f"settings {name!r}: no cap or estimate for {', '.join(missing)}")
    over = [s for s in STAGE_ORDER if settings.estimates[s] > settings.caps[s]]
    if over:
        raise ValueError(f"settings {name!r}: estimates above their caps for {', '.join(over)}")
    total = sum(settings.caps.values())
    if total > settings.budget_s:
        raise ValueError(
            f"settings {name!r}: stage caps add up to {total:.0f} s against a {settings.budget_s:.0f} s "
            "budget; later stages would not run"
        )


def with_extra(settings: Settings) -> Settings:
    """``--extra``: the settings with the cut scope back, caps and budget grown to fit it."""
    extra = settings.extra
    if extra is None:
        return settings
    caps = {name: cap + extra.caps.get(name, 0) for name, cap in settings.caps.items()}
    estimates = {name: est + extra.caps.get(name, 0) for name, est in settings.estimates.items()}
    return replace(
        settings,
        caps=caps,
        estimates=estimates,
        budget_s=settings.budget_s + sum(extra.caps.values()),
        compiled_presets=extra.compiled_presets,
        peers_models=extra.peers_models,
        deselected_tests=(),
        extra=None,
    )


COMPILED_PLANS_TEST = "test_inductor_compiled_plans_stay_within_the_compile_noise_floor"

SETTINGS: dict[str, Settings] = {
    # One H200, torch 2.11; estimated, not yet measured (docs/benchmarks.md, "The GPU suite",
    # gives the reasoning per stage). The budget is what one 10-minute device command leaves
    # after the machine's start and the set-up: 600 - 120 - 45 = 435 s, rounded down to 420.
    # Caps sit 10-20% above the estimates and add up to the budget, so every stage gets its
    # whole cap even when all overrun.
    "gpu": Settings(
        caps={
            "tests": 80,
            "allocator": 50,
            "offload": 40,
            "bench_dense": 40,
            "compiled": 85,
            "plan": 65,
            "bench_moe": 50,
            "peers": 10,
        },
        estimates={
            "tests": 70,
            "allocator": 40,  # 10 cases of two steps from an empty cache, ~3 s each
            "offload": 35,
            "bench_dense": 35,
            "compiled": 75,
            "plan": 55,  # 45, and the roofline profile of the same model (one clocked step each)
            "bench_moe": 40,
            "peers": 5,  # nothing but its report: the peers moved to --extra for the allocator stage
        },
        budget_s=420,
        repeats=3,
        warmup=1,
        offload_repeats=9,
        bandwidth_bytes=1 << 30,
        profile_repeats=3,
        peers_models=(),
        compiled_presets=("none", "matmuls"),
        deselected_tests=(COMPILED_PLANS_TEST,),
        # Cut to fit: the fp32 compiled-plans test (one more cold Inductor compile; the compiled
        # stage checks the same at GPU size), `full` with compiled layers (one more), the peers
        # (a profile and ~15 rows per model; the allocator stage took their 50 s).
        extra=Extra(
            caps={"tests": 35, "compiled": 35, "peers": 140},
            compiled_presets=("none", "full", "matmuls"),
            peers_models=("dense", "moe"),
        ),
    ),
    # Two shared CPU cores, tiny models: the rehearsal of every code path. Estimates are the
    # rehearsal's measured times; caps leave twice that for a busy machine.
    "tiny": Settings(
        caps={
            "tests": 60,
            "allocator": 90,
            "offload": 90,
            "bench_dense": 120,
            "compiled": 120,
            "plan": 120,
            "bench_moe": 150,
            "peers": 150,
        },
        estimates={
            "tests": 15,
            "allocator": 30,
            "offload": 30,
            "bench_dense": 50,
            "compiled": 35,
            "plan": 55,
            "bench_moe": 65,
            "peers": 35,
        },
        budget_s=900,
        repeats=2,
        warmup=0,
        offload_repeats=3,
        bandwidth_bytes=1 << 20,
        profile_repeats=1,
        # The MoE profile alone takes minutes on two busy cores; bench_moe rehearses the MoE rows.
        peers_models=("dense",),
        compiled_presets=("none", "matmuls"),
        deselected_tests=(COMPILED_PLANS_TEST,),
        extra=Extra(
            caps={"tests": 30, "compiled": 60},
            compiled_presets=("none", "full", "matmuls"),
            peers_models=("dense",),
        ),
    ),
}
for _name, _settings in SETTINGS.items():
    check_settings(_name, _settings)
    check_settings(f"{_name} --extra", with_extra(_settings))


@dataclass
class StageContext:
    """What a stage process knows: where to write, which models, on which device."""

    name: str
    out: Path
    scale: str
    device: torch.device
    cache_dir: Path
    settings: Settings
    tests_file: str = "tests/test_cuda.py"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def spec(self, model: str) -> ModelSpec:
        return SCALES[self.scale][model]

    def profile_name(self, model: str) -> str:
        """The model's name in the profile cache; the same in every stage, so profiles are shared."""
        spec = self.spec(model)
        return f"{model}-{self.scale}-{spec.dtype}"


# ---------------------------------------------------------------------------------------------
# Deterministic algorithms for the parity steps


DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Set in every stage process's environment before CUDA initialises: cuBLAS is deterministic
with it, and ``torch.use_deterministic_algorithms`` requires it on CUDA."""
_CUBLAS_CONFIGS = (":4096:8", ":16:8")
NONDETERMINISTIC_ALERT = "does not have a deterministic implementation"


def deterministic_allowed(device: torch.device) -> tuple[bool, str]:
    """Whether this process can turn on deterministic algorithms, and why not when it cannot."""
    if device.type != "cuda":
        return True, ""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config not in _CUBLAS_CONFIGS:
        return False, (
            f"CUBLAS_WORKSPACE_CONFIG is {config!r}, not one of {', '.join(_CUBLAS_CONFIGS)}, "
            "so cuBLAS cannot be deterministic (the suite sets it for its stage processes)"
        )
    return True, ""


@dataclass
class Determinism:
    """Deterministic algorithms around the parity steps of one stage (``torch.use_deterministic_
    algorithms(True, warn_only=True)``), off for the timed and memory-measured steps, so those
    run the kernels people train with. Ops without a deterministic implementation warn instead
    of failing; they are collected in ``nondeterministic_ops`` (the noise floor then is not 0).
    """

    device: torch.device
    wanted: bool = True
    reason: str = ""
    nondeterministic_ops: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.wanted:
            allowed, why = deterministic_allowed(self.device)
            if not allowed:
                self.wanted, self.reason = False, why

    @property
    def on(self) -> bool:
        return self.wanted

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """Deterministic algorithms inside the block (when ``on``); the previous setting after."""
        if not self.on:
            yield
            return
        before = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
        finally:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        for w in caught:
            text = str(w.message)
            if NONDETERMINISTIC_ALERT in text:
                self.nondeterministic_ops.add(text.split(NONDETERMINISTIC_ALERT)[0].strip()[:200])
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def record(self, where: str) -> dict[str, Any]:
        """What a stage report states about it."""
        return {
            "on": self.on,
            "where": where if self.on else "nowhere",
            "warn_only": True,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "reason_off": self.reason,
            "nondeterministic_ops": sorted(self.nondeterministic_ops),
        }


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
