"""``actplan estimate``: what a real-scale training step needs, per preset, before the hardware
exists: the memory per GPU and an estimated step time on a named accelerator.

Each preset runs one training step of the reference model at the requested shape on fake
tensors (``measure.FakeRun``: nothing the size of the model is allocated) under the memory meter
and the roofline clock. What the step allocates is measured; two things are formulas, stated
here and in docs/concepts.md:

- **static memory per GPU**: FSDP2 with bf16 compute and fp32 everything else: 16 bytes per
  parameter (fp32 parameter, gradient and AdamW's two moments) sharded over ``fsdp`` ranks,
  plus the bf16 parameters of two gathered units (the one computing and the one prefetched),
  sized as the largest of the decoder layers, the embedding and the output head;
- **gradients**: each parameter's gradient is dropped as soon as it is complete, as FSDP's
  reduce-scatter frees the unsharded gradient, so the measured peak holds activations and the
  backward's transients, not a whole model's gradients.

Times are estimates (``measure.RooflineClock``): forward and backward only, no communication,
no optimizer step. Imports measure, models, install and config.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from typing import Any

import torch
import yaml
from torch import nn

from actplan._install.apply import apply, find_layers
from actplan.measure import FakeRun, MemoryMeter, RooflineClock, accelerator
from actplan.models import build_model, loss_of

__all__ = [
    "DTYPES",
    "EstimateResult",
    "EstimateRow",
    "Shape",
    "estimate",
    "load_shape",
    "preset_step",
    "shape_names",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_ffn", "first_k_dense")


@dataclass(frozen=True)
class Shape:
    """A decoder's shape and one GPU's batch: what the estimate builds (``model``: the reference
    model, ``dense`` or ``moe``). ``batch`` is per GPU (per FSDP rank)."""

    model: str = "dense"
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256
    seq: int = 8192
    batch: int = 1
    dtype: str = "bf16"
    experts: int | None = None
    top_k: int | None = None
    expert_ffn: int | None = None
    shared_ffn: int | None = None
    first_k_dense: int | None = None
    name: str = "custom"

    def check(self) -> None:
        """Raise ``ValueError`` naming the numbers that do not fit together."""
        if self.model not in ("dense", "moe"):
            raise ValueError(f"model {self.model!r}: the estimate builds 'dense' or 'moe'")
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"head size hidden/heads = {self.hidden // self.heads} must be even (RoPE)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        moe_given = [name for name in _MOE_FIELDS if getattr(self, name) is not None]
        if self.model == "dense" and moe_given:
            raise ValueError(
                f"{', '.join(moe_given)} apply to model 'moe' only; drop them or use --model moe"
            )
        if self.model == "moe":
            missing = [name for name in ("experts", "top_k", "expert_ffn") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"model 'moe' needs {', '.join(missing)} (--experts, --top-k, --expert-ffn)")
            if not 0 < self.top_k <= self.experts:
                raise ValueError(f"top_k ({self.top_k}) must be between 1 and experts ({self.experts})")
            if self.first_k_dense is not None and not 0 <= self.first_k_dense <= self.layers:
                raise ValueError(
                    f"first_k_dense ({self.first_k_dense}) must be within 0..layers ({self.layers})"
                )

    def model_overrides(self) -> dict[str, Any]:
        """The reference model's config fields for this shape."""
        overrides: dict[str, Any] = {
            "n_layers": self.layers,
            "dim": self.hidden,
            "n_heads": self.heads,
            "n_kv_heads": self.kv_heads,
            "ffn_dim": self.ffn,
            "vocab_size": self.vocab,
            "max_seq_len": self.seq,
            "seq_len": self.seq,
            "batch_size": self.batch,
        }
        if self.model == "moe":
            names = {"experts": "n_experts", "top_k": "top_k", "expert_ffn": "expert_ffn_dim"}
            names |= {"shared_ffn": "shared_expert_ffn_dim", "first_k_dense": "first_k_dense"}
            overrides |= {names[f]: getattr(self, f) for f in _MOE_FIELDS if getattr(self, f) is not None}
        return overrides

    def describe(self) -> str:
        text = (
            f"{self.name}: {self.model}, {self.layers} layers, hidden {self.hidden}, {self.heads} heads "
            f"({self.kv_heads} KV), ffn {self.ffn}, vocab {self.vocab}"
        )
        if self.model == "moe":
            text += f", {self.experts} experts (top {self.top_k}, ffn {self.expert_ffn})"
        return text + f"; {self.batch} x {self.seq} tokens per GPU, {self.dtype}"


def shape_names() -> list[str]:
    """The shapes shipped with actplan (``actplan/models/shapes/*.yaml``)."""
    folder = resources.files("actplan.models") / "shapes"
    return sorted(
        entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml")
    )


def load_shape(name: str, **overrides: Any) -> Shape:
    """A shipped shape by name, with ``overrides`` (``seq=4096``, ...) applied; checked."""
    known = shape_names()
    if name not in known:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(known)}")
    text = (resources.files("actplan.models") / "shapes" / f"{name}.yaml").read_text()
    data = yaml.safe_load(text)
    valid = {f.name for f in fields(Shape)}
    unknown = set(data) - valid
    if unknown:
        raise ValueError(f"shape file {name}.yaml has unknown fields {sorted(unknown)}")
    shape = replace(Shape(**data, name=name), **{k: v for k, v in overrides.items() if v is not None})
    shape.check()
    return shape


@dataclass
class EstimateRow:
    """One preset's step at the estimated shape, on one GPU."""

    preset: str
    activation_bytes: int  # alive at the end of forward
    step_peak_bytes: int  # what the step allocates at its peak (activations, transients)
    peak_bytes: int  # step_peak_bytes plus the static memory
    flops: int
    seconds: float  # roofline estimate of forward and backward
    ratio_to_none: float | None = None
    fits: bool | None = None


@dataclass
class EstimateResult:
    shape: dict[str, Any]
    description: str
    gpu: str
    gpu_source: str
    fsdp: int
    parameters: int
    static_bytes: int
    gathered_bytes: int
    budget_bytes: int | None
    rows: list[EstimateRow] = field(default_factory=list)
    seconds_taken: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def recommended(self) -> EstimateRow | None:
        """The fastest preset that fits the budget (the fastest overall without one)."""
        fitting = [row for row in self.rows if row.fits is not False]
        return min(fitting, key=lambda row: row.seconds) if fitting else None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _drop_grads_when_complete(model: nn.Module) -> None:
    # As FSDP's reduce-scatter frees the unsharded gradient once it is complete.
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def _largest_unit_params(model: nn.Module) -> int:
    units = [layer for _, layer in find_layers(model)]
    units += [m for m in model.modules() if isinstance(m, nn.Embedding)]
    units += [m for name, m in model.named_modules() if name.endswith(("output", "lm_head"))]
    return max(sum(p.numel() for p in unit.parameters()) for unit in units)


def preset_step(shape: Shape, preset: str, gpu: str, fake: bool = True) -> tuple[EstimateRow, int, int]:
    """One preset's metered, clocked step at ``shape``; with ``fake=False`` the same step on real
    tensors (the tests compare the two). Returns the row, the parameter count and the largest
    unit's parameter count."""
    run = FakeRun() if fake else contextlib.nullcontext()
    with _default_dtype(DTYPES[shape.dtype]), run:
        bundle = build_model(shape.model, "small", **shape.model_overrides())
        model = bundle.model
        if preset != "none":
            apply(model, preset)
        _drop_grads_when_complete(model)
        parameters = sum(p.numel() for p in model.parameters())
        largest_unit = _largest_unit_params(model)
        batch = bundle.batch(0, FakeRun.device)
        clock = RooflineClock(gpu)
        meter = MemoryMeter(model)
        with meter, clock:
            loss = loss_of(model(**batch))
            forward_end = meter.mark("forward_end").activation_bytes
            loss.backward()
        report = meter.report()
    row = EstimateRow(
        preset=preset,
        activation_bytes=forward_end,
        step_peak_bytes=report.peak_live_bytes,
        peak_bytes=0,
        flops=clock.flops,
        seconds=clock.seconds,
    )
    return row, parameters, largest_unit


def estimate(
    shape: Shape,
    presets: Sequence[str] = ("none", "full", "attn", "matmuls", "megatron-selective"),
    *,
    gpu: str = "h100",
    fsdp: int = 1,
    budget_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> EstimateResult:
    """Each preset's memory per GPU and estimated step time at ``shape`` (see the module doc)."""
    shape.check()
    accel = accelerator(gpu)
    if fsdp < 1:
        raise ValueError(f"fsdp must be 1 or more ranks, got {fsdp}")
    if not presets:
        raise ValueError("no presets to estimate; name at least one (e.g. none,full)")
    started = time.perf_counter()
    rows, parameters, largest_unit = [], 0, 0
    for preset in presets:
        if progress is not None:
            progress(f"estimating {preset} on fake tensors")
        row, parameters, largest_unit = preset_step(shape, preset, accel.name)
        rows.append(row)
    static = 16 * parameters // fsdp
    gathered = 2 * largest_unit * DTYPES[shape.dtype].itemsize
    none_seconds = next((r.seconds for r in rows if r.preset == "none"), None)
    for row in rows:
        row.peak_bytes = static + gathered + row.step_peak_bytes
        row.ratio_to_none = None if none_seconds is None else row.seconds / none_seconds
        row.fits = None if budget_bytes is None else row.peak_bytes <= budget_bytes
    return EstimateResult(
        shape=asdict(shape),
        description=shape.describe(),
        gpu=accel.name,
        gpu_source=accel.source,
        fsdp=fsdp,
        parameters=parameters,
        static_bytes=static,
        gathered_bytes=gathered,
        budget_bytes=budget_bytes,
        rows=rows,
        seconds_taken=time.perf_counter() - started,
        notes=[
            f"times are estimates from a roofline clock for {accel.name} (vendor peaks, no kernel "
            "efficiency, no communication, no optimizer step); memory is measured on fake tensors",
            "static memory is a formula: 16 bytes per parameter (fp32 parameter, gradient, AdamW "
            f"moments) over {fsdp} FSDP rank(s), plus two gathered units' {shape.dtype} parameters",
        ],
    )
