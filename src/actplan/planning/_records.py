"""The planning package's records: what a profile holds (each candidate's measured costs,
grouped by layer type, and the model's fixed costs; as JSON for the cache) and what the
planner solves (``Candidate``, ``PlanProblem``: ``actplan.planning.planner`` is their public
home), with the config entry of one candidate (``choice_of``).

A leaf of the package, so that the planner, its solvers, the profiler and ``choose`` all
import it and not each other. Imports the standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PROFILE_FORMAT = 6  # 3: chain by unit forward time; 4: boundary grads; 5: per-layer extras;
# 6: stolen rounds left out of the timing, each time with its spread
# A time has settled once its spread (interquartile range over the square root of the rounds)
# is at most this share of the time it is measured against (a layer's `none`, the step).
SETTLED_SHARE = 0.05


@dataclass(frozen=True)
class Candidate:
    """One way to run a layer, with its measured costs."""

    name: str  # e.g. "full", "none", "keep attn_core+mlp_up", "full+offload"
    retained_bytes: float
    transient_bytes: float
    extra_seconds: float
    offloaded_bytes: float = 0.0


@dataclass(frozen=True)
class PlanProblem:
    """Per layer (forward order), the candidates it may take; and the memory outside the layers."""

    layers: tuple[tuple[Candidate, ...], ...]
    static_bytes: float  # parameters and optimizer state
    base_seconds: float
    nonlayer_bytes: float = 0.0  # activations outside the layers, alive when backward starts
    layer_grad_bytes: tuple[float, ...] = ()  # per layer; empty means none
    other_grad_bytes: float = 0.0  # gradients of parameters outside the layers
    optimizer_step_bytes: float = 0.0  # the optimizer step's temporaries
    # Calibration: what measured backward peaks hold beyond the model above (the loss head's
    # backward, allocator timing); added to every backward phase.
    backward_extra_bytes: float = 0.0
    head_transient_bytes: float = 0.0  # the loss head's backward, at backward start
    # Offload reloads this many earlier layers during a layer's backward (counted in its phase).
    prefetch_layers: int = 0
    # Per layer, measured: what runs during its backward, or before the layer below it starts
    # (a loss head in mid-model, as multi-token prediction has), beyond the model above.
    layer_extra_bytes: tuple[float, ...] = ()
    # The most bytes the offloaded candidates may move to the host tier, summed over the layers
    # (every offloaded tensor is on the host at the end of forward); ``None``: no limit.
    host_budget_bytes: float | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(
                "a plan problem needs at least one layer; pass layers=[candidates of layer 0, ...] "
                "(actplan.planning.budget builds it from a profile)"
            )
        for index, candidates in enumerate(self.layers):
            if not candidates:
                raise ValueError(
                    f"layer {index} has no candidates; give every layer at least one (its 'none' "
                    "candidate, no checkpointing, always fits)"
                )
        for index, candidates in enumerate(self.layers):
            for candidate in candidates:
                for cost in ("retained_bytes", "transient_bytes", "extra_seconds", "offloaded_bytes"):
                    value = getattr(candidate, cost)
                    if not math.isfinite(value):
                        raise ValueError(
                            f"layer {index}, candidate {candidate.name!r}: {cost} is {value}; costs must be "
                            "finite numbers (a failed measurement? profile again with --refresh)"
                        )
        if self.host_budget_bytes is not None and not self.host_budget_bytes >= 0:
            raise ValueError(
                f"host_budget_bytes is {self.host_budget_bytes}; give the pinned host bytes the "
                "offloaded layers may use (0 or more), or None for no limit"
            )
        if self.layer_extra_bytes and len(self.layer_extra_bytes) != len(self.layers):
            raise ValueError(
                f"layer_extra_bytes has {len(self.layer_extra_bytes)} entries for {len(self.layers)} "
                "layers; give one per layer, or none"
            )
        if self.layer_grad_bytes and len(self.layer_grad_bytes) != len(self.layers):
            raise ValueError(
                f"layer_grad_bytes has {len(self.layer_grad_bytes)} entries for {len(self.layers)} layers; "
                "give one entry per layer, or leave it empty for none"
            )

    def _grads(self) -> tuple[float, ...]:
        return self.layer_grad_bytes or (0.0,) * len(self.layers)

    def extras(self) -> tuple[float, ...]:
        """Per layer, its measured extra backward bytes (zeros when none were given)."""
        return self.layer_extra_bytes or (0.0,) * len(self.layers)

    def grads_after(self) -> list[float]:
        """Per layer ``i``, gradient bytes of layers after it (already produced in backward)."""
        grads = self._grads()
        return [sum(grads[i + 1 :]) for i in range(len(grads))]

    @property
    def optimizer_phase_bytes(self) -> float:
        return self.static_bytes + self.other_grad_bytes + sum(self._grads()) + self.optimizer_step_bytes

    def phases(self, choices: Sequence[int]) -> list[float]:
        """Predicted bytes of every phase: backward start, each layer's backward (forward
        order), the optimizer step."""
        picked = [self.layers[i][c] for i, c in enumerate(choices)]
        after = self.grads_after()
        extra = self.extras()
        base = self.static_bytes + self.backward_extra_bytes
        phases = [
            base + self.nonlayer_bytes + self.head_transient_bytes + sum(p.retained_bytes for p in picked)
        ]
        retained = 0.0
        for i, p in enumerate(picked):
            retained += p.retained_bytes
            prefetched = sum(q.offloaded_bytes for q in picked[max(i - self.prefetch_layers, 0) : i])
            phases.append(
                base + self.other_grad_bytes + retained + p.transient_bytes + prefetched + after[i] + extra[i]
            )
        phases.append(self.optimizer_phase_bytes)
        return phases

    def peak(self, choices: Sequence[int]) -> float:
        return max(self.phases(choices))

    def host_bytes(self, choices: Sequence[int]) -> float:
        """What the chosen candidates move to the host tier, summed: all of it is there when
        forward ends."""
        return float(sum(self.layers[i][c].offloaded_bytes for i, c in enumerate(choices)))

    def host_fits(self, choices: Sequence[int]) -> bool:
        """Whether ``choices`` keep within the host budget (always, without one)."""
        budget = self.host_budget_bytes
        return budget is None or self.host_bytes(choices) <= budget * (1 + 1e-9) + 1

    def seconds(self, choices: Sequence[int]) -> float:
        return self.base_seconds + sum(self.layers[i][c].extra_seconds for i, c in enumerate(choices))


def choice_of(mode: str, kept: tuple[str, ...]) -> dict[str, Any]:
    """The config entry that installs one candidate: its mode, and its kept units when selective."""
    if mode == "selective":
        return {"mode": "selective", "keep": list(kept)}
    return {"mode": mode}


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
    # How loose ``extra_seconds`` is (its paired differences' interquartile range over the
    # square root of the rounds, seconds), and whether that came under the settled share of
    # ``none``'s time. An estimate's (and an older profile's) are 0 and True.
    extra_seconds_spread: float = 0.0
    timing_settled: bool = True

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
    # The accelerator whose roofline clock gave every time (estimates), or None: timed here.
    roofline_gpu: str | None = None
    # Whether every time settled (each candidate's and ``base_seconds``); the largest spread
    # of a candidate's extra time as a share of its layer type's ``none`` time; the spread
    # of ``base_seconds`` (seconds). An older profile's: settled, no spread.
    timing_settled: bool = True
    timing_spread: float = 0.0
    base_seconds_spread: float = 0.0

    def type_of(self, index: int) -> LayerTypeProfile:
        key = self.layer_type_of[index]
        return next(t for t in self.layer_types if t.key == key)

    def problem(self, host_budget_bytes: float | None = None) -> PlanProblem:
        """The planner's input: every layer's candidates with their measured costs (their
        offloaded bytes within ``host_budget_bytes``, when given)."""
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
            host_budget_bytes=host_budget_bytes,
        )

    def loose_timings(self) -> list[tuple[str, str, float]]:
        """Every candidate whose time did not settle, loosest first: its layer type's class,
        its name and its spread as a share of that type's ``none`` time. An offloaded variant
        shares its candidate's timing and is not listed again."""
        loose = []
        for layer_type in self.layer_types:
            none = layer_type.candidate("none").layer_seconds
            for c in layer_type.candidates:
                if not c.timing_settled and not c.offload:
                    share = c.extra_seconds_spread / none if none > 0 else math.inf
                    loose.append((layer_type.class_name, c.name, share))
        return sorted(loose, key=lambda item: -item[2])

    def timing_warning(self, shown: int = 3) -> str | None:
        """One line when the times are loose: which candidates, by how much, and the fix;
        ``None`` when every time settled."""
        if self.timing_settled:
            return None
        loose = self.loose_timings()
        several = len({class_name for class_name, _, _ in loose}) > 1
        parts = [
            f"{name}{f' ({class_name})' if several else ''} ±{share:.0%}"
            for class_name, name, share in loose[:shown]
        ]
        what = [f"{', '.join(parts)} of the layer's time"] if parts else []
        if len(loose) > shown:
            what[0] += f" (and {len(loose) - shown} more candidates)"
        if self.base_seconds_spread > SETTLED_SHARE * self.base_seconds:
            what.append(f"the step without checkpointing ±{self.base_seconds_spread / self.base_seconds:.0%}")
        return (
            f"timing did not settle: {'; '.join(what)}. The machine was busy: rerun when it is idle, "
            "or raise --repeats"
        )

    def ratio_spread(self, names: Sequence[str]) -> float:
        """How loose the predicted step-time ratio of a plan is: per layer (forward order) its
        candidate's name. Layers of one type share one measurement, so spreads add up."""
        extra = spread = 0.0
        for index, name in enumerate(names):
            candidate = self.type_of(index).candidate(name)
            extra += candidate.extra_seconds
            spread += candidate.extra_seconds_spread
        if self.base_seconds <= 0:
            return 0.0
        return spread / self.base_seconds + extra * self.base_seconds_spread / self.base_seconds**2

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
