"""Generated decoder-like layers for the eager engine's property tests
(``test_engine_properties.py``).

A layer is a small *program* (``LayerSpec``): a list of ``Op``s over a register file of
tensors of shape (B, T, D). Register 0 is the layer input; every op reads registers written
before it and appends one new register. ``GeneratedLayer`` interprets the program in its
``forward`` and emits ``checkpoint_record`` markers around random *spans* of it (nested or
disjoint, balanced), and declares the matching ``RecomputeIntervalMap``. ``GeneratedStack``
chains layers (each feeding the next) under a loss.

The Hypothesis strategies are ``stacks()`` (two layers of one shape, or one layer twice),
``layer_specs()`` and its parts ``programs()`` and ``span_sets()``. The vocabulary covers what a
decoder layer does: linear layers and weight matmuls, SDPA (causal or not), eager attention
(bmm + softmax chain), norms (LayerNorm, ``F.rms_norm``), elementwise ops, gated products and
residual adds, views and transposes, dropout, in-place updates of fresh tensors, top-k routing
whose integer counts Python reads with ``.tolist()`` (with weights renormalised in place or
not), and tensor, tuple or dict outputs. Registers no op reads are added into the output, so
no op is dead code; a layer either keeps every register alive until it returns (as locals do)
or lets each go after its last reader. Shapes are tiny (fp32, CPU): an example costs tens of
milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from actplan.markers import checkpoint_record
from actplan.units import MarkerInterval, RecomputeIntervalMap, RecomputeUnit

BATCH = 2
EXPERTS = 3

# Op kinds by how many registers they read.
UNARY = (
    "linear",
    "matmul",
    "layernorm",
    "rmsnorm",
    "gelu",
    "silu",
    "tanh",
    "softmax",
    "scale",
    "permute",
    "flatten",
    "dropout",
    "inplace",
    "route",
)
BINARY = ("mul", "add")
TERNARY = ("sdpa", "eager_attention")
ARITY = {**dict.fromkeys(UNARY, 1), **dict.fromkeys(BINARY, 2), **dict.fromkeys(TERNARY, 3)}
# How many variants each kind has (bias or not, causal or not, dropout p, ...).
VARIANTS = {
    "linear": 2,
    "dropout": 2,
    "inplace": 4,
    "route": 4,
    "sdpa": 2,
    "eager_attention": 2,
    "softmax": 2,
}
# In-place updates that write into a tensor made one op before: what each variant calls.
INPLACE_OPS = ("add_", "mul_", "relu_", "clamp_")
ALL_UNITS = tuple(RecomputeUnit)


@dataclass(frozen=True)
class Op:
    """One step of a layer program: ``kind`` reads registers ``inputs`` and writes a new one."""

    kind: str
    inputs: tuple[int, ...]
    variant: int = 0


@dataclass(frozen=True)
class Span:
    """Ops ``start`` to ``end - 1`` of the program, one interval of ``unit``."""

    start: int
    end: int
    unit: str


@dataclass(frozen=True)
class LayerSpec:
    """A generated layer: its program, its marker spans and what it returns."""

    dim: int
    seq: int
    heads: int
    ops: tuple[Op, ...]
    spans: tuple[Span, ...]
    shared_markers: bool  # one marker per boundary (intervals share names) or one per interval end
    output: str  # "tensor", "tuple" or "dict"
    aux: int  # the register a tuple or dict output also returns
    # Whether the forward lets go of each register after its last reader, as code whose
    # temporaries die does (else every register lives until the forward returns).
    release_dead: bool = False
    # A deliberate mutation (``mutation_cases`` only): (op index, register written in place),
    # applied after that op when the layer's ``mutate`` flag is on.
    mutation: tuple[int, int] | None = None

    @property
    def op_sequence(self) -> tuple[str, ...]:
        return tuple(f"{op.kind}:{op.variant}" for op in self.ops)

    @property
    def placement(self) -> tuple:
        return (len(self.ops), tuple((s.start, s.end) for s in self.spans), self.shared_markers)

    def intervals(self) -> list[MarkerInterval]:
        """The marker interval of each span, in span order."""
        if self.shared_markers:
            return [MarkerInterval(f"m{s.start}", f"m{s.end}") for s in self.spans]
        return [MarkerInterval(f"s{i}", f"e{i}") for i in range(len(self.spans))]

    def interval_map(self) -> RecomputeIntervalMap:
        units: dict[str, list[MarkerInterval]] = {}
        for span, interval in zip(self.spans, self.intervals(), strict=True):
            units.setdefault(span.unit, []).append(interval)
        return RecomputeIntervalMap(units)

    def markers_at(self) -> list[list[str]]:
        """The markers emitted at each boundary 0..len(ops) (boundary i comes before op i)."""
        at: list[list[str]] = [[] for _ in range(len(self.ops) + 1)]
        if self.shared_markers:
            for span in self.spans:
                for boundary in (span.start, span.end):
                    if f"m{boundary}" not in at[boundary]:
                        at[boundary].append(f"m{boundary}")
            return at
        indexed = list(enumerate(self.spans))
        for boundary in range(len(self.ops) + 1):
            # Close innermost first (latest start), then open outermost first (latest end).
            ends = sorted((s for s in indexed if s[1].end == boundary), key=lambda s: -s[1].start)
            starts = sorted((s for s in indexed if s[1].start == boundary), key=lambda s: -s[1].end)
            at[boundary] = [f"e{i}" for i, _ in ends] + [f"s{i}" for i, _ in starts]
        return at

    def last_reads(self) -> dict[int, list[int]]:
        """For each op index, the registers nothing reads after it (the outputs excepted)."""
        last: dict[int, int] = {}
        for index, op in enumerate(self.ops):
            for register in op.inputs:
                last[register] = index
        keep = {len(self.ops), *(() if self.mutation is None else (self.mutation[1],))}
        if self.output != "tensor":
            keep.add(self.aux)
        dead: dict[int, list[int]] = {}
        for register, index in last.items():
            if register not in keep:
                dead.setdefault(index, []).append(register)
        return dead

    def unread(self) -> list[int]:
        """Registers no op reads and the layer does not return: added into the output, so no
        op is dead code (autograd would free what dead code saves; routing outputs are held
        whatever reads them, so a checkpointed layer would hold more than no checkpointing)."""
        read = {register for op in self.ops for register in op.inputs}
        returned = {self.aux} if self.output != "tensor" else set()
        return [r for r in range(1, len(self.ops)) if r not in read and r not in returned]

    def ops_in(self, span_indices) -> set[int]:
        """Indices of the ops inside any of the given spans."""
        return {i for j in span_indices for i in range(self.spans[j].start, self.spans[j].end)}


# ---------------------------------------------------------------------------------------------
# The strategy


def _laminar(spans: list[tuple[int, int]], candidate: tuple[int, int]) -> bool:
    # Marker intervals must nest or be disjoint (sharing a boundary is fine).
    s, e = candidate
    for s2, e2 in spans:
        if (s, e) == (s2, e2):
            return False
        disjoint = e <= s2 or e2 <= s
        nested = (s <= s2 and e2 <= e) or (s2 <= s and e <= e2)
        if not (disjoint or nested):
            return False
    return True


@st.composite
def programs(draw, dim: int, seq: int, heads: int, min_ops: int = 2, max_ops: int = 7) -> tuple[Op, ...]:
    """A program of ``min_ops``..``max_ops`` ops; inputs lean to the newest register."""
    count = draw(st.integers(min_ops, max_ops))
    ops = []
    for index in range(count):
        registers = index + 1
        kind = draw(st.sampled_from((*UNARY, *BINARY, *TERNARY)))
        inputs = tuple(
            draw(st.one_of(st.just(registers - 1), st.integers(0, registers - 1))) for _ in range(ARITY[kind])
        )
        variant = draw(st.integers(0, VARIANTS.get(kind, 1) - 1))
        ops.append(Op(kind, inputs, variant))
    # At least one parameterised op, so the layer is checkpointed (it needs gradients either way).
    if ops and not any(op.kind in ("linear", "matmul", "layernorm", "rmsnorm", "route") for op in ops):
        ops[draw(st.integers(0, count - 1))] = Op("linear", (0,), 0)
    return tuple(ops)


@st.composite
def span_sets(draw, op_count: int, max_spans: int = 4) -> tuple[Span, ...]:
    """1..``max_spans`` non-empty, laminar spans of a program, grouped into distinct units."""
    wanted = draw(st.integers(1, max_spans))
    pairs: list[tuple[int, int]] = []
    for _ in range(wanted * 3):  # a few tries per span: some candidates overlap earlier ones
        if len(pairs) == wanted:
            break
        start = draw(st.integers(0, op_count - 1))
        end = draw(st.integers(start + 1, op_count))
        if _laminar(pairs, (start, end)):
            pairs.append((start, end))
    # Most units have one interval; some take two (keep by unit then keeps both).
    unit_count = draw(st.integers(max(1, len(pairs) - 1), len(pairs)))
    units = draw(st.lists(st.sampled_from(ALL_UNITS), min_size=unit_count, max_size=unit_count, unique=True))
    owners = [units[i] if i < unit_count else draw(st.sampled_from(units)) for i in range(len(pairs))]
    return tuple(Span(s, e, unit.value) for (s, e), unit in zip(pairs, owners, strict=True))


@st.composite
def layer_specs(draw, dim: int, seq: int, heads: int, min_ops: int = 2, max_ops: int = 7) -> LayerSpec:
    """A random generated layer of the given shape (see the module docstring)."""
    ops = draw(programs(dim, seq, heads, min_ops, max_ops))
    spans = draw(span_sets(len(ops)))
    output = draw(st.sampled_from(("tensor", "tuple", "dict")))
    aux = draw(st.integers(0, len(ops)))
    shared_markers, release_dead = draw(st.booleans()), draw(st.booleans())
    return LayerSpec(dim, seq, heads, ops, spans, shared_markers, output, aux, release_dead)


@st.composite
def stacks(draw, max_ops: int = 7) -> tuple[LayerSpec, LayerSpec]:
    """Two layers of one shape: two programs, or one program twice (so a plan's layers share
    a policy, as layers of one class do)."""
    dim = draw(st.sampled_from((8, 12, 16)))
    seq = draw(st.sampled_from((4, 6, 8)))
    heads = draw(st.sampled_from((1, 2)))
    first = draw(layer_specs(dim, seq, heads, max_ops=max_ops))
    if draw(st.booleans()):
        return first, first
    return first, draw(layer_specs(dim, seq, heads, max_ops=max_ops))


# ---------------------------------------------------------------------------------------------
# The modules


class Weight(nn.Module):
    """A bare (D, D) weight for ``x @ w`` and a gain for ``F.rms_norm``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(dim))


class Router(nn.Module):
    """A top-k router over ``EXPERTS`` linear experts."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(EXPERTS))


class GeneratedLayer(nn.Module):
    """Interprets a ``LayerSpec``; ``recompute_intervals`` is its spans' interval map.

    ``spec_hook``, when set, is called with each op's index before the op runs (and ``None``
    after the last), so a dispatch mode can attribute aten ops to program ops. ``mutate``
    turns the spec's deliberate mutation on.
    """

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.recompute_intervals = spec.interval_map()
        self.markers = spec.markers_at()
        self.dead_after = spec.last_reads() if spec.release_dead else {}
        self.unread = spec.unread()
        self.spec_hook: Any = None
        self.mutate = True
        modules = {}
        for index, op in enumerate(spec.ops):
            name = f"op{index}"
            if op.kind == "linear":
                modules[name] = nn.Linear(spec.dim, spec.dim, bias=op.variant == 0)
            elif op.kind in ("matmul", "rmsnorm"):
                modules[name] = Weight(spec.dim)
            elif op.kind == "layernorm":
                modules[name] = nn.LayerNorm(spec.dim)
            elif op.kind == "route":
                modules[name] = Router(spec.dim)
        self.ops = nn.ModuleDict(modules)

    def forward(self, x: torch.Tensor) -> Any:
        spec = self.spec
        registers = [x]
        for index, op in enumerate(spec.ops):
            for marker in self.markers[index]:
                checkpoint_record(marker)
            if self.spec_hook is not None:
                self.spec_hook(index)
            registers.append(self._run(index, op, [registers[i] for i in op.inputs]))
            if spec.mutation is not None and spec.mutation[0] == index and self.mutate:
                registers[spec.mutation[1]].mul_(2.0)
            for register in self.dead_after.get(index, ()):
                registers[register] = None
        if self.spec_hook is not None:
            self.spec_hook(None)
        for marker in self.markers[len(spec.ops)]:
            checkpoint_record(marker)
        out, aux = registers[-1], registers[spec.aux]
        for register in self.unread:
            out = out + registers[register]
        if spec.output == "tuple":
            return out, aux
        if spec.output == "dict":
            return {"hidden": out, "aux": aux, "tokens": spec.seq}
        return out

    def _run(self, index: int, op: Op, args: list[torch.Tensor]) -> torch.Tensor:
        spec = self.spec
        batch, seq, dim = args[0].shape
        module = self.ops[f"op{index}"] if f"op{index}" in self.ops else None  # noqa: SIM401 (ModuleDict)
        a = args[0]
        kind = op.kind
        if kind == "linear":
            return module(a)
        if kind == "matmul":
            return torch.matmul(a, module.weight)
        if kind == "layernorm":
            return module(a)
        if kind == "rmsnorm":
            return F.rms_norm(a, (dim,), module.gain, eps=1e-5)
        if kind == "gelu":
            return F.gelu(a)
        if kind == "silu":
            return F.silu(a)
        if kind == "tanh":
            return torch.tanh(a)
        if kind == "softmax":
            return a.softmax(-1) * dim if op.variant == 0 else F.log_softmax(a, dim=-1)
        if kind == "scale":
            return a * 0.5 + 0.25
        if kind == "permute":  # a view, a transpose and a copying reshape
            return a.view(batch, seq, 2, dim // 2).transpose(-1, -2).reshape(batch, seq, dim)
        if kind == "flatten":  # views only
            return a.reshape(batch * seq, dim).view(batch, seq, dim)
        if kind == "dropout":
            return F.dropout(a, p=(0.1, 0.5)[op.variant], training=self.training)
        if kind == "inplace":
            return _inplace(a, op.variant)
        if kind == "route":
            return _route(module, a, k=1 + op.variant % 2, renormalise=op.variant >= 2)
        if kind == "mul":  # a gate, bounded so chains of products stay finite
            return a * torch.tanh(args[1])
        if kind == "add":
            return a + args[1]
        if kind == "sdpa":
            heads = spec.heads

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(batch, seq, heads, dim // heads).transpose(1, 2)

            o = F.scaled_dot_product_attention(
                split(a), split(args[1]), split(args[2]), is_causal=op.variant == 1
            )
            return o.transpose(1, 2).reshape(batch, seq, dim)
        if kind == "eager_attention":
            scores = torch.matmul(a, args[1].transpose(-2, -1)) * dim**-0.5
            if op.variant == 1:
                mask = torch.ones(seq, seq, dtype=torch.bool, device=a.device).triu(1)
                scores = scores.masked_fill(mask, float("-inf"))
            return torch.matmul(scores.softmax(-1), args[2])
        raise ValueError(f"unknown op kind {kind!r}")


def _inplace(a: torch.Tensor, variant: int) -> torch.Tensor:
    # Each writes into a tensor the op before it made (nothing autograd saved), as model code does.
    if variant == 0:
        h = a * 2.0
        h.add_(1.0)
    elif variant == 1:
        h = a + 1.0
        h.mul_(0.5)
    elif variant == 2:
        h = a.clone()
        h.relu_()
    else:
        h = a * 1.5
        with torch.no_grad():
            h.clamp_(-2.0, 2.0)
    return h


def _route(router: Router, a: torch.Tensor, k: int, renormalise: bool) -> torch.Tensor:
    # Top-k routing: integer counts read by Python (.tolist()) size the per-expert splits.
    batch, seq, dim = a.shape
    tokens = a.reshape(batch * seq, dim)
    weights, ids = router.gate(tokens).softmax(-1).topk(k, dim=-1)
    if renormalise:  # Mixtral-style, in place on the routing output
        weights /= weights.sum(-1, keepdim=True)
    flat_ids = ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=EXPERTS).tolist()
    parts = tokens[order // k].split(counts)
    expert_out = torch.cat([expert(part) for expert, part in zip(router.experts, parts, strict=True)])
    restored = expert_out[order.argsort()]
    return (restored.view(batch * seq, k, dim) * weights.unsqueeze(-1)).sum(1).view(batch, seq, dim)


class GeneratedStack(nn.Module):
    """Generated layers in a row under a loss: an input parameter feeds the first layer, each
    layer's hidden output the next, and every layer's aux output joins the loss."""

    def __init__(self, specs: list[LayerSpec], seed: int) -> None:
        super().__init__()
        # Parameters and data both follow from the seed. (The CPU generator only: torch.manual_seed
        # also queues CUDA seeding, with a stack trace, costing milliseconds per call.)
        torch.default_generator.manual_seed(seed)
        shape = (BATCH, specs[0].seq, specs[0].dim)
        self.embed = nn.Parameter(torch.randn(shape))
        self.layers = nn.ModuleList(GeneratedLayer(spec) for spec in specs)
        self.register_buffer("probe", torch.randn(shape))

    def forward(self) -> torch.Tensor:
        hidden = self.embed
        loss = hidden.new_zeros(())
        for layer in self.layers:
            out = layer(hidden)
            if isinstance(out, dict):
                hidden, aux = out["hidden"], out["aux"]
            elif isinstance(out, tuple):
                hidden, aux = out
            else:
                hidden, aux = out, None
            if aux is not None:
                loss = loss + (aux * self.probe).mean()
        return loss + (hidden * self.probe).sum()
