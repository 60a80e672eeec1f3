"""What every GPU-suite stage shares: the per-scale settings (stage caps, budget, timing rounds),
the stage order, the context a stage process runs in, and its progress line on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu.models import SCALES, ModelSpec


@dataclass(frozen=True)
class Settings:
    """Per scale: stage caps (seconds), the suite's total budget, timing rounds."""

    caps: dict[str, float]
    budget_s: float
    repeats: int
    warmup: int
    bandwidth_bytes: int
    profile_repeats: int
    peers_models: tuple[str, ...]


STAGE_ORDER = ("tests", "offload", "bench_dense", "compiled", "plan", "bench_moe", "peers")

SETTINGS: dict[str, Settings] = {
    # Estimated (not yet measured) on one H200, start-up included: tests 110 s (Inductor
    # compiles most of it), offload 35, bench_dense 45, compiled 110 (three Inductor
    # compiles), plan 60, bench_moe 40, peers 90: 8.2 minutes, so the budget may cut into
    # `peers`, the last stage, which keeps every row it finished. Caps are looser than the
    # estimates; a stage that needs its whole cap takes the time from the stages after it.
    "gpu": Settings(
        caps={
            "tests": 150,
            "offload": 60,
            "bench_dense": 75,
            "compiled": 150,
            "plan": 90,
            "bench_moe": 60,
            "peers": 120,
        },
        budget_s=465,
        repeats=5,
        warmup=1,
        bandwidth_bytes=1 << 30,
        profile_repeats=3,
        peers_models=("dense", "moe"),
    ),
    # Two shared CPU cores, tiny models: the rehearsal of every code path.
    "tiny": Settings(
        caps={name: 240 for name in STAGE_ORDER},
        budget_s=1200,
        repeats=2,
        warmup=0,
        bandwidth_bytes=1 << 20,
        profile_repeats=1,
        # The MoE profile alone takes minutes on two busy cores; bench_moe rehearses the MoE rows.
        peers_models=("dense",),
    ),
}


@dataclass
class StageContext:
    """What a stage process knows: where to write, which models, on which device."""

    name: str
    out: Path
    scale: str
    device: torch.device
    cache_dir: Path
    settings: Settings

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def spec(self, model: str) -> ModelSpec:
        return SCALES[self.scale][model]

    def profile_name(self, model: str) -> str:
        """The model's name in the profile cache; the same in every stage, so profiles are shared."""
        spec = self.spec(model)
        return f"{model}-{self.scale}-{spec.dtype}"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
