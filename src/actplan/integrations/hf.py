"""Hugging Face ``transformers`` decoder layers, as they are: units declared by module path.

A unit is a list of spans; a span is a submodule path (its entry and exit are the span's
markers) or a pair of points ``("path:exit", "other.path:enter")`` (what runs between
them, such as RoPE and the attention kernel, which are function calls rather than
modules). ``declare(model)`` finds the decoder layers of a supported architecture, puts
forward pre/post hooks on the named submodules that emit ``checkpoint_record`` markers
(module hooks are traced by ``torch.compile``, so the markers survive compilation) and
gives each layer its ``recompute_intervals``; ``actplan.apply`` then treats the layers
like any other. ``undeclare`` removes every hook and attribute again.

``actplan.apply(hf_model, config)`` calls ``declare`` by itself. Imports: ``markers``,
``units`` and ``config`` (for its error type); ``transformers`` is never imported here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from actplan.config import ConfigError
from actplan.markers import checkpoint_record
from actplan.units import MarkerInterval, RecomputeIntervalMap, RecomputeUnit

Span = str | tuple[str, str]

_ATTENTION = {
    RecomputeUnit.ATTN_NORM: ["input_layernorm"],
    RecomputeUnit.QKV_PROJ: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    RecomputeUnit.QK_NORM: ["self_attn.q_norm", "self_attn.k_norm"],
    # RoPE, the attention kernel and the reshapes around them: no module of their own.
    RecomputeUnit.ATTN_CORE: [("self_attn.v_proj:exit", "self_attn.o_proj:enter")],
    RecomputeUnit.ATTN_PROJ: ["self_attn.o_proj"],
    RecomputeUnit.MLP_NORM: ["post_attention_layernorm"],
}
# The current transformers MoE layout: a top-k router module and fused experts.
_MOE_MLP = {
    RecomputeUnit.MOE_ROUTER: ["mlp.gate"],
    RecomputeUnit.MOE_EXPERTS: ["mlp.experts"],
}
_DENSE_MLP = {
    RecomputeUnit.MLP_UP: ["mlp.gate_proj", "mlp.up_proj"],
    RecomputeUnit.MLP_ACT: ["mlp.act_fn"],
    RecomputeUnit.MLP_DOWN: ["mlp.down_proj"],
}
LAYOUTS: dict[str, dict[RecomputeUnit, list[Span]]] = {
    "LlamaDecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "MistralDecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "Qwen2DecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "Qwen3DecoderLayer": {**_ATTENTION, **_DENSE_MLP},
    "Qwen3MoeDecoderLayer": {**_ATTENTION, **_DENSE_MLP, **_MOE_MLP},
}
"""Built-in declarations by decoder layer class name. A span whose module is missing in a
given layer (a dense layer of an MoE model, a model without QK-norm) is left out.

Qwen3-MoE routers with ``norm_topk_prob=True`` normalise their top-k weights in place,
which a saved routing output cannot survive: such models need ``save_collectives: false``
and the router recomputed (the error says so). Older per-expert MoE layouts (a
``ModuleList`` of experts) are not declared."""

_STATE_ATTR = "_actplan_hf"


@dataclass
class _Declared:
    layers: list[nn.Module] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    # config.use_cache before declare turned it off (None: left alone).
    use_cache: bool | None = None


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model (checked without importing transformers)."""
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def interval_map_for(
    layer: nn.Module, layout: Mapping[RecomputeUnit, Sequence[Span]]
) -> RecomputeIntervalMap:
    """The units ``layer`` has under ``layout``; spans whose modules are absent are dropped."""
    units: dict[RecomputeUnit, list[MarkerInterval]] = {}
    for unit, spans in layout.items():
        intervals = []
        for span in spans:
            if isinstance(span, str):
                if _has(layer, span):
                    intervals.append(MarkerInterval(f"{span}:enter", f"{span}:exit"))
            else:
                start, end = span
                if all(_has(layer, point.rpartition(":")[0]) for point in (start, end)):
                    intervals.append(MarkerInterval(start, end))
        if intervals:
            units[unit] = intervals
    return RecomputeIntervalMap(units)


def _mark(marker: str):
    def hook(*_: Any) -> None:
        checkpoint_record(marker)

    return hook


def declare(
    model: nn.Module, layouts: Mapping[str, Mapping[RecomputeUnit, Sequence[Span]]] | None = None
) -> int:
    """Declare the units of every supported decoder layer in ``model``; returns how many.

    ``layouts`` adds to or replaces the built-in declarations (class name -> unit -> spans).
    Raises ``ConfigError`` when Hugging Face's own gradient checkpointing is on (both would
    checkpoint the same layers) or when no layer class is known.
    """
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ConfigError(
            "Hugging Face gradient checkpointing is enabled on this model, and actplan would "
            "checkpoint the same layers again; call model.gradient_checkpointing_disable() and let "
            "actplan's config decide what is recomputed"
        )
    undeclare(model)
    known = {**LAYOUTS, **(layouts or {})}
    state = _Declared()
    for module in model.modules():
        layout = known.get(type(module).__name__)
        if layout is None:
            continue
        interval_map = interval_map_for(module, layout)
        markers = interval_map.markers
        for name, sub in module.named_modules():
            if f"{name}:enter" in markers:
                state.handles.append(sub.register_forward_pre_hook(_mark(f"{name}:enter")))
            if f"{name}:exit" in markers:
                state.handles.append(sub.register_forward_hook(_mark(f"{name}:exit")))
        module.recompute_intervals = interval_map
        state.layers.append(module)
    if not state.layers:
        classes = sorted(
            {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}
        )
        found = ", ".join(classes) or "no *DecoderLayer classes"
        raise ConfigError(
            f"no decoder layer of {type(model).__name__} has a built-in actplan declaration "
            f"(found {found}; known: {', '.join(sorted(LAYOUTS))}); pass "
            "layouts={'MyDecoderLayer': {unit: [module paths]}} to actplan.integrations.hf.declare"
        )
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A KV cache passed to every layer is appended to again when a layer is recomputed,
        # so the replay would attend over twice the keys. Transformers turns it off under its
        # own gradient checkpointing too; `undeclare` restores it.
        warnings.warn(
            f"actplan sets {type(model).__name__}.config.use_cache = False while its plan is "
            "installed: a KV cache would change between a layer's forward and its recompute",
            stacklevel=3,
        )
        state.use_cache = True
        config.use_cache = False
    model.__dict__[_STATE_ATTR] = state
    return len(state.layers)


def undeclare(model: nn.Module) -> bool:
    """Remove the hooks and ``recompute_intervals`` that ``declare`` added."""
    state: _Declared | None = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return False
    for handle in state.handles:
        handle.remove()
    for layer in state.layers:
        layer.__dict__.pop("recompute_intervals", None)
    if state.use_cache is not None:
        model.config.use_cache = state.use_cache
    return True


def is_declared(model: nn.Module) -> bool:
    return _STATE_ATTR in model.__dict__


def known_interval_map(module: nn.Module) -> RecomputeIntervalMap | None:
    """The built-in declaration of a ``transformers`` decoder layer, or ``None``."""
    layout = LAYOUTS.get(type(module).__name__)
    if layout is None or not type(module).__module__.startswith("transformers."):
        return None
    return interval_map_for(module, layout)


# ---------------------------------------------------------------------------------------------
# Small random-weight models of the supported architectures (tests, verify, bench)

_REFERENCE_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024),
}  # fmt: skip
_BATCH = {"tiny": (2, 16), "small": (2, 256)}
REFERENCE_KINDS = ("llama", "qwen2", "qwen3", "qwen3-moe")


def reference_model(kind: str, size: str = "tiny") -> tuple[nn.Module, Any]:
    """A randomly initialised ``transformers`` model of ``kind`` and a batch maker: what
    ``--model hf-<kind>`` runs. Needs ``transformers`` (``pip install actplan[hf]``)."""
    if kind not in REFERENCE_KINDS or size not in _REFERENCE_SHAPES:
        raise ValueError(
            f"unknown Hugging Face reference model hf-{kind} ({size}); kinds: {', '.join(REFERENCE_KINDS)}, "
            f"sizes: {', '.join(_REFERENCE_SHAPES)}"
        )
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError("hf-* models need transformers: pip install 'actplan[hf]'") from None
    shapes = {**_REFERENCE_SHAPES[size], "use_cache": False}
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shapes))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shapes, head_dim=16))
    else:
        config = transformers.Qwen3MoeConfig(
            **shapes, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=shapes["intermediate_size"] // 4, mlp_only_layers=[0],
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
    rows, seq = _BATCH[size]
    vocab = shapes["vocab_size"]

    def make_batch(seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, :-1].contiguous()}

    return model.train(), make_batch
