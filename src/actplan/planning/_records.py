"""What a profile holds: each candidate's measured costs, grouped by layer type, and the
model's fixed costs; as JSON for the cache, and as the planner's ``PlanProblem``.

Imports the planner (its problem types) and ``choose`` (a candidate's config entry).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from actplan.planning.choose import choice_of
from actplan.planning.planner import Candidate, PlanProblem

PROFILE_FORMAT = 5  # 3: chain by unit forward time; 4: boundary grads; 5: per-layer extras


@dataclass
class CandidateProfile:
    """One way to run a layer type, and what it cost."""

    name: str
    mode: str  # none, full, selective
    kept_units: list[str]
    offload: bool  # layer input and kept units moved to the host tier
    retained_bytes: int = 0
    transient_bytes: int = 0
    layer_seconds: float = 0.0
    extra_seconds: float = 0.0
    offloaded_bytes: int = 0

    @property
    def key(self) -> tuple[str, tuple[str, ...], bool]:
        """What makes two candidates the same way to run a layer (mode, kept units, offload)."""
        return (self.mode, tuple(self.kept_units), self.offload)

    def config_choice(self) -> dict[str, Any]:
        return choice_of(self.mode, tuple(self.kept_units))


@dataclass
class LayerTypeProfile:
    key: str
    class_name: str
    layer_indices: list[int]
    candidates: list[CandidateProfile]

    def candidate(self, name: str) -> CandidateProfile:
        return next(c for c in self.candidates if c.name == name)


@dataclass
class ModelProfile:
    model: str
    cache_key: str
    device: str
    torch_version: str
    param_bytes: int
    optimizer_bytes: int
    layer_grad_bytes: list[int]
    other_grad_bytes: int
    optimizer_step_bytes: int
    nonlayer_activation_bytes: int
    base_seconds: float
    none_peak_bytes: int
    full_peak_bytes: int
    bandwidth_bytes_per_s: dict[str, float]
    copies_overlap: bool
    min_bytes: int
    layer_types: list[LayerTypeProfile]
    layer_type_of: list[str]  # per layer index, its type key
    # Measured backward peaks of `none` and `full` beyond what the phase model predicts for
    # them (the loss head's backward, mostly); the planner adds it to every backward phase.
    backward_extra_bytes: int = 0
    # Per layer, what the measured runs hold during its backward (and before the layer below
    # starts) beyond the phase model: a loss head in mid-model, say. Added to its phase.
    layer_backward_extra_bytes: list[int] = field(default_factory=list)
    # What the loss head's backward (logits gradient, softmax) needs on top, measured.
    head_transient_bytes: int = 0
    # Offload's prefetch depth the plans are written with (OffloadConfig's default).
    prefetch_layers: int = 1
    seconds_spent: float = 0.0

    def type_of(self, index: int) -> LayerTypeProfile:
        key = self.layer_type_of[index]
        return next(t for t in self.layer_types if t.key == key)

    def problem(self) -> PlanProblem:
        """The planner's input: every layer's candidates with their measured costs."""
        layers = []
        for index in range(len(self.layer_type_of)):
            layers.append(
                tuple(
                    Candidate(c.name, c.retained_bytes, c.transient_bytes, c.extra_seconds, c.offloaded_bytes)
                    for c in self.type_of(index).candidates
                )
            )
        return PlanProblem(
            layers=tuple(layers),
            static_bytes=self.param_bytes + self.optimizer_bytes,
            base_seconds=self.base_seconds,
            nonlayer_bytes=self.nonlayer_activation_bytes,
            layer_grad_bytes=tuple(self.layer_grad_bytes),
            other_grad_bytes=self.other_grad_bytes,
            optimizer_step_bytes=self.optimizer_step_bytes,
            backward_extra_bytes=self.backward_extra_bytes,
            layer_extra_bytes=tuple(self.layer_backward_extra_bytes),
            head_transient_bytes=self.head_transient_bytes,
            prefetch_layers=self.prefetch_layers,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        data = json.loads(text)
        data["layer_types"] = [
            LayerTypeProfile(**{**t, "candidates": [CandidateProfile(**c) for c in t["candidates"]]})
            for t in data["layer_types"]
        ]
        return cls(**data)
