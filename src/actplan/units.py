"""The vocabulary: recompute units, marker intervals and a layer's interval map.

Leaf module: pure Python, imports nothing from torch or the rest of actplan, so
config resolution and planning can use it without side effects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum


class RecomputeUnit(StrEnum):
    """A user-facing, semantic activation a layer produces.

    A unit is *kept* when every op that runs inside its marker intervals has its
    output saved in forward (so backward reads it instead of replaying the op),
    and *recomputed* otherwise. Values are the strings used in config files.
    ``UNIT_DESCRIPTIONS`` says, unit by unit, what the tensor is and what
    keeping it costs and saves.
    """

    ATTN_NORM = "attn_norm"
    QKV_PROJ = "qkv_proj"
    QK_NORM = "qk_norm"
    ROPE = "rope"
    ATTN_CORE = "attn_core"
    ATTN_PROJ = "attn_proj"
    ATTN_POST_NORM = "attn_post_norm"
    MLP_NORM = "mlp_norm"
    MLP_UP = "mlp_up"
    MLP_ACT = "mlp_act"
    MLP_DOWN = "mlp_down"
    MLP_POST_NORM = "mlp_post_norm"
    MOE_ROUTER = "moe_router"
    MOE_DISPATCH = "moe_dispatch"
    MOE_EXPERTS = "moe_experts"
    MOE_ACT = "moe_act"
    MOE_COMBINE = "moe_combine"
    SHARED_EXPERTS = "shared_experts"
    SPARSE_INDEXER = "sparse_indexer"


# Per token, d = hidden size, q/kv = query/key-value widths, f = MLP width,
# k = experts per token. "Costs" is the memory kept; "saves" the work skipped.
UNIT_DESCRIPTIONS: dict[RecomputeUnit, str] = {
    RecomputeUnit.ATTN_NORM: (
        "The norm before attention (RMSNorm or LayerNorm): its output and statistics (about "
        "2d+1 values). Cheap elementwise work; keeping it rarely pays."
    ),
    RecomputeUnit.QKV_PROJ: (
        "Query, key and value projections (q+2kv values). Keeping them skips three "
        "GEMMs in backward: the best time saved per byte in most layers."
    ),
    RecomputeUnit.QK_NORM: (
        "Per-head norm of queries and keys (Qwen3 style), about q+kv values. Cheap to recompute."
    ),
    RecomputeUnit.ROPE: (
        "Rotary position embedding applied to queries and keys (q+kv values). "
        "Elementwise; keep it only when attention itself is recomputed."
    ),
    RecomputeUnit.ATTN_CORE: (
        "The attention itself: with a fused kernel (SDPA/flash) its output and log-sum-exp (q "
        "values plus one per head); with eager attention also the s x s scores and "
        "probabilities. Quadratic in sequence length to recompute."
    ),
    RecomputeUnit.ATTN_PROJ: (
        "Attention output projection (d values). Keeping it skips one GEMM; the "
        "residual stream after attention is rebuilt from it with one add."
    ),
    RecomputeUnit.ATTN_POST_NORM: (
        "Norm applied to the attention output before the residual add (Gemma 2/3 and OLMo 2 "
        "post-norms), about 2d+1 values. Cheap elementwise work; keeping it rarely pays."
    ),
    RecomputeUnit.MLP_NORM: (
        "The norm before the MLP (RMSNorm or LayerNorm), about 2d+1 values. Cheap elementwise work."
    ),
    RecomputeUnit.MLP_UP: (
        "The MLP's input projections: up, plus gate in a gated MLP such as SwiGLU (f or 2f "
        "values). The largest GEMMs of a dense layer; keeping them saves the most recompute "
        "time and costs the most memory."
    ),
    RecomputeUnit.MLP_ACT: (
        "The MLP's activation: SiLU(gate) * up in SwiGLU, GELU(up) in a plain MLP (f values). "
        "Elementwise; the input of the down projection."
    ),
    RecomputeUnit.MLP_DOWN: (
        "Down projection output (d values). Backward never needs it, so keeping it "
        "costs memory and saves nothing when recompute stops early."
    ),
    RecomputeUnit.MLP_POST_NORM: (
        "Norm applied to the MLP output before the residual add (Gemma 2/3 and OLMo 2 "
        "post-norms), about 2d+1 values. Cheap elementwise work; keeping it rarely pays."
    ),
    RecomputeUnit.MOE_ROUTER: (
        "Router logits, scores and the top-k choice (E + 2k values). Tiny; routing "
        "decisions are saved whatever the plan."
    ),
    RecomputeUnit.MOE_DISPATCH: (
        "Tokens permuted (and exchanged across ranks) to their experts (k*d values)."
    ),
    RecomputeUnit.MOE_EXPERTS: ("Grouped expert GEMMs, gate/up and down (k*(2f+d) values)."),
    RecomputeUnit.MOE_ACT: ("The experts' activation (SwiGLU in most MoE models, k*f values), elementwise."),
    RecomputeUnit.MOE_COMBINE: ("Expert outputs weighted and summed back per token (k*d values)."),
    RecomputeUnit.SHARED_EXPERTS: ("The always-on shared expert MLP (2f+d values)."),
    RecomputeUnit.SPARSE_INDEXER: (
        "Indexer scores and top-k key ids for sparse attention. The ids are integer "
        "routing data and are saved whatever the plan."
    ),
}


ROUTING_UNITS: frozenset[RecomputeUnit] = frozenset(
    {
        RecomputeUnit.MOE_ROUTER,
        RecomputeUnit.MOE_DISPATCH,
        RecomputeUnit.MOE_COMBINE,
        RecomputeUnit.SPARSE_INDEXER,
    }
)
"""Units whose layers route tokens or share ids: a plain full recompute would
rerun their top-k and collectives, so ``full`` keeps their routing outputs."""


@dataclass(frozen=True, slots=True)
class MarkerInterval:
    """A half-open span of a layer's forward between two markers.

    Ops that run after ``checkpoint_record(start)`` and before
    ``checkpoint_record(end)`` belong to the interval.
    """

    start: str
    end: str

    def __post_init__(self) -> None:
        for name, marker in (("start", self.start), ("end", self.end)):
            if not isinstance(marker, str) or not marker:
                raise ValueError(f"MarkerInterval {name} must be a non-empty string, got {marker!r}")
        if self.start == self.end:
            raise ValueError(
                f"MarkerInterval({self.start!r}, {self.end!r}) is empty: start and end must be "
                "different markers"
            )

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


class RecomputeIntervalMap(Mapping[RecomputeUnit, tuple[MarkerInterval, ...]]):
    """A layer class's declaration of which marker intervals make up each unit.

    Build it from ``{unit: interval}`` or ``{unit: [interval, ...]}``; unit keys
    may be ``RecomputeUnit`` members or their string values::

        RecomputeIntervalMap({
            "attn_norm": MarkerInterval("attn_norm", "qkv_proj"),
            "qkv_proj": MarkerInterval("qkv_proj", "rope"),
        })

    The map is immutable and hashable. Two units may not claim the same interval.
    """

    __slots__ = ("_hash", "_intervals", "_markers")

    def __init__(
        self,
        declaration: Mapping[RecomputeUnit | str, MarkerInterval | Iterable[MarkerInterval]],
    ) -> None:
        intervals: dict[RecomputeUnit, tuple[MarkerInterval, ...]] = {}
        owner: dict[MarkerInterval, RecomputeUnit] = {}
        for key, value in declaration.items():
            unit = parse_unit(key)
            spans = (value,) if isinstance(value, MarkerInterval) else tuple(value)
            if not spans:
                raise ValueError(
                    f"unit {unit.value!r} is declared with no intervals; give it at least one "
                    "MarkerInterval(start, end), or drop the unit"
                )
            for span in spans:
                if not isinstance(span, MarkerInterval):
                    raise TypeError(
                        f"unit {unit.value!r}: expected MarkerInterval, got {type(span).__name__}"
                    )
                if span in owner:
                    raise ValueError(
                        f"interval {span} is declared for both {owner[span].value!r} and "
                        f"{unit.value!r}; give each unit its own markers"
                    )
                owner[span] = unit
            intervals[unit] = spans
        if not intervals:
            raise ValueError(
                "a RecomputeIntervalMap needs at least one unit; declare one, e.g. "
                "RecomputeIntervalMap({'mlp_up': MarkerInterval('up', 'act')}), or drop the "
                "recompute_intervals attribute from a layer with nothing to declare"
            )
        self._intervals = intervals
        self._markers = frozenset(m for spans in intervals.values() for s in spans for m in (s.start, s.end))
        self._hash = hash(tuple(sorted((u.value, spans) for u, spans in intervals.items())))

    def __getitem__(self, unit: RecomputeUnit | str) -> tuple[MarkerInterval, ...]:
        return self._intervals[parse_unit(unit)]

    def __iter__(self) -> Iterator[RecomputeUnit]:
        return iter(self._intervals)

    def __len__(self) -> int:
        return len(self._intervals)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecomputeIntervalMap) and self._intervals == other._intervals

    def __repr__(self) -> str:
        body = ", ".join(
            f"{u.value}: {' + '.join(str(s) for s in spans)}" for u, spans in self._intervals.items()
        )
        return f"RecomputeIntervalMap({body})"

    @property
    def units(self) -> tuple[RecomputeUnit, ...]:
        """Declared units, in declaration order."""
        return tuple(self._intervals)

    @property
    def markers(self) -> frozenset[str]:
        """Every marker name any interval starts or ends at."""
        return self._markers

    def intervals_of(self, units: Iterable[RecomputeUnit | str]) -> frozenset[MarkerInterval]:
        """All intervals that make up ``units``; every unit must be declared."""
        out: set[MarkerInterval] = set()
        for unit in units:
            u = parse_unit(unit)
            if u not in self._intervals:
                raise KeyError(u.value)
            out.update(self._intervals[u])
        return frozenset(out)

    def unit_of(self, interval: MarkerInterval) -> RecomputeUnit:
        for unit, spans in self._intervals.items():
            if interval in spans:
                return unit
        raise KeyError(str(interval))


MarkerIndex = dict[str, tuple[MarkerInterval, ...]]


def marker_index(intervals: Iterable[MarkerInterval]) -> tuple[MarkerIndex, MarkerIndex]:
    """For each marker, the intervals that open at it and the intervals that close at it, each in
    the order ``intervals`` gives them: what a marker sink looks up on every marker event."""
    opens: dict[str, list[MarkerInterval]] = {}
    closes: dict[str, list[MarkerInterval]] = {}
    for span in intervals:
        opens.setdefault(span.start, []).append(span)
        closes.setdefault(span.end, []).append(span)
    return (
        {marker: tuple(spans) for marker, spans in opens.items()},
        {marker: tuple(spans) for marker, spans in closes.items()},
    )


def parse_unit(value: RecomputeUnit | str) -> RecomputeUnit:
    """Return the ``RecomputeUnit`` for ``value``; unknown names get an error listing valid ones."""
    if isinstance(value, RecomputeUnit):
        return value
    try:
        return RecomputeUnit(value)
    except ValueError:
        valid = ", ".join(u.value for u in RecomputeUnit)
        raise ValueError(f"unknown recompute unit {value!r}; valid units: {valid}") from None
