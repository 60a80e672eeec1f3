"""Derive a decoder layer's units from the names and nesting of its submodules.

Hugging Face decoder families share a small vocabulary of submodule names: attention
input projections (``q_proj``, ``qkv_proj``, ``c_attn``, ``query_key_value``, ``Wqkv``,
the MLA ``q_a_proj`` / ``kv_a_proj_with_mqa`` / ``kv_b_proj``, ...) next to one output
projection (``o_proj``, ``c_proj``, ``dense``, ``out_proj``), MLP projections (``gate_proj``,
``up_proj``, ``gate_up_proj``, ``fc1``, ``c_fc`` / ``down_proj``, ``fc2``, ``c_proj``), an
``experts`` module with a router (``gate``, ``router``) and shared experts beside it, and
norms named for where they sit (``input_layernorm``, ``pre_feedforward_layernorm``,
``post_attention_layernorm``, ``ln_1``). Other PyTorch decoders use the same words:
torchtitan's blocks (``attention.qkv_linear.wqkv``, ``attention.wo``, MLA's ``wq_a`` /
``wkv_b``, ``attention.rope``, ``feed_forward.w1``, ``moe.router``, ``moe.routed_experts``
around ``inner_experts``, ``attention_norm``, ``ffn_norm``) and nanoGPT's (``attn.c_attn``,
``mlp.c_fc``, ``ln_1``), which ``blocks`` derives with this module. A name is read in the
context of where it sits (``c_proj`` is the attention output under the attention module
and the MLP down projection elsewhere), never by the layer's class, so families not seen
before derive the same way.

``derive_layout(layer)`` returns the layout (unit -> spans) and, when it is unsure, what
it found and what is missing. The engine's exactness never depends on the layout (a
unit only decides what is kept); a wrong guess costs memory or time, so derivation refuses
rather than guesses when the structure is ambiguous. Imports: ``units``; torch's ``nn``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from actplan.units import RecomputeUnit

Span = str | tuple[str, str]

PROJECTED = "projected"
"""The point ``"<attention path>:projected"``: emitted once the last of the layout's
``qkv_proj`` modules under that path has run, whatever order the attention calls them in."""

# Leaf names (lower case) by role. A name is only read where its role can sit: input and
# output projections under the attention module, MLP names outside it.
ATTENTION_INPUTS = frozenset({
    "q_proj", "k_proj", "v_proj", "qkv_proj", "kv_proj", "c_attn", "query_key_value", "wqkv",
    "query", "key", "value", "qkv", "in_proj", "wq", "wk", "wv", "q_lin", "k_lin", "v_lin",
    "q_a_proj", "q_b_proj", "kv_a_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "wq_a", "wq_b", "wkv_a", "wkv_b",
})  # fmt: skip
ATTENTION_OUTPUTS = frozenset({"o_proj", "c_proj", "dense", "out_proj", "wo", "o", "proj", "out_lin"})
MLP_UP = frozenset({
    "gate_proj", "up_proj", "gate_up_proj", "fc1", "c_fc", "w1", "w3", "fc_in", "dense_h_to_4h",
    "wi", "wi_0", "wi_1", "lin1",
})  # fmt: skip
MLP_DOWN = frozenset({"down_proj", "fc2", "c_proj", "w2", "fc_out", "dense_4h_to_h", "wo", "lin2"})
MLP_ACT = frozenset({"act_fn", "act", "activation_fn", "activation", "gelu_impl", "gelu", "act_layer"})
EXPERTS = frozenset({"experts", "routed_experts"})
ROUTERS = frozenset({"gate", "router", "gate_network", "switch", "wg"})
SHARED_EXPERTS = frozenset({"shared_expert", "shared_experts", "shared_mlp", "shared_expert_gate"})
ROPE = frozenset({"rope"})

_ATTENTION_WORDS = frozenset({"attn", "attention", "self", "sa"})
_MLP_WORDS = frozenset({"mlp", "ffn", "feedforward", "feed", "ff", "moe"})


@dataclass(frozen=True)
class Derivation:
    """What ``derive_layout`` found: the units, and why it is unsure (empty when it is not)."""

    units: dict[RecomputeUnit, list[Span]]
    reasons: tuple[str, ...] = ()

    @property
    def sure(self) -> bool:
        return not self.reasons


def _leaf(path: str) -> str:
    return path.rpartition(".")[2].lower()


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _under(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def is_norm(path: str, module: nn.Module) -> bool:
    """A normalisation module, by class name (``*Norm``) or leaf name (``*norm*``, ``ln_1``)."""
    name = _leaf(path)
    return (
        "norm" in type(module).__name__.lower()
        or "norm" in name
        or re.fullmatch(r"ln(_?\w+)?", name) is not None
    )


def norm_role(name: str) -> str | None:
    """Where a layer-level norm sits, read from its name: ``pre_attn``, ``pre_mlp``,
    ``post_attn``, ``post_mlp`` or ``None`` (no telling)."""
    words = set(re.split(r"[_.\d]+", name.lower())) - {""}
    attention = bool(words & _ATTENTION_WORDS) or name in ("ln_1",)
    mlp = bool(words & _MLP_WORDS) or name in ("ln_2",)
    if "post" in words and attention and not mlp:
        return "post_attn"
    if "post" in words and mlp and not attention:
        return "post_mlp"
    if "post" in words:
        return None
    if mlp and not attention:
        return "pre_mlp"
    if (attention and not mlp) or "input" in words:
        return "pre_attn"
    return None


@dataclass
class _Found:
    """What one pass over a layer's submodules found, by role."""

    attention: str | None = None
    inputs: list[str] = field(default_factory=list)
    output: str | None = None
    qk_norms: list[str] = field(default_factory=list)
    rope: list[str] = field(default_factory=list)
    moe: str | None = None
    experts_module: str | None = None
    experts: list[str] = field(default_factory=list)
    # An experts module that wraps one inner experts module (torchtitan's ``routed_experts``
    # around ``inner_experts``): the token dispatch before it and the combine after it.
    dispatch: list[Span] = field(default_factory=list)
    combine: list[Span] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    mlp_up: list[str] = field(default_factory=list)
    mlp_down: list[str] = field(default_factory=list)
    mlp_act: list[str] = field(default_factory=list)
    norms: dict[str, list[str]] = field(default_factory=dict)  # role -> paths
    reasons: list[str] = field(default_factory=list)


def _find_attention(modules: dict[str, nn.Module], found: _Found) -> None:
    inputs = [p for p in modules if p and _leaf(p) in ATTENTION_INPUTS]
    parents = sorted({_parent(p) for p in inputs})
    if not inputs:
        found.reasons.append(
            f"no attention input projection (a submodule named one of {', '.join(sorted(ATTENTION_INPUTS))})"
        )
        return
    if len(parents) > 1:
        found.reasons.append(
            f"attention input projections under more than one module ({', '.join(parents)}): "
            "cross-attention or several attentions per layer"
        )
        return
    # The attention is the nearest module, from the projections' parent up, with an output
    # projection as a direct child (torchtitan keeps q, k, v in ``attention.qkv_linear``).
    attention, outputs = parents[0], []
    while True:
        outputs = [p for p in modules if p and _parent(p) == attention and _leaf(p) in ATTENTION_OUTPUTS
                   and p not in inputs]  # fmt: skip
        if outputs or not attention:
            break
        attention = _parent(attention)
    if len(outputs) != 1:
        what = ", ".join(outputs) if outputs else "none"
        found.reasons.append(
            f"attention {parents[0] or '<layer>'} needs exactly one output projection named one of "
            f"{', '.join(sorted(ATTENTION_OUTPUTS))} beside its input projections or above them "
            f"(found: {what})"
        )
        return
    found.attention, found.inputs, found.output = attention, inputs, outputs[0]
    if attention:
        found.qk_norms = [p for p, m in modules.items() if _under(p, attention) and p != attention
                          and is_norm(p, m) and not _children(m)]  # fmt: skip
        found.rope = [p for p in modules if _parent(p) == attention and _leaf(p) in ROPE]


def _find_moe(modules: dict[str, nn.Module], found: _Found) -> None:
    experts = [
        p for p in modules
        if p and _leaf(p) in EXPERTS and not (found.attention is not None and _under(p, found.attention))
    ]  # fmt: skip
    if not experts:
        return
    if len(experts) > 1:
        found.reasons.append(f"more than one experts module ({', '.join(experts)})")
        return
    (path,) = experts
    moe = _parent(path)
    container = modules[path]
    inner = [f"{path}.{name}" for name, _ in container.named_children() if name.lower().endswith("experts")]
    # Experts held as a ModuleList are called one by one: each expert is a span.
    if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        found.experts = [f"{path}.{name}" for name, _ in container.named_children()]
    elif len(inner) == 1:
        found.experts = inner
        found.dispatch = [(f"{path}:enter", f"{inner[0]}:enter")]
        found.combine = [(f"{inner[0]}:exit", f"{path}:exit")]
    else:
        found.experts = [path]
    found.moe, found.experts_module = moe, path
    siblings = [p for p in modules if p and _parent(p) == moe]
    found.routers = [p for p in siblings if _leaf(p) in ROUTERS]
    found.shared = [p for p in siblings if _leaf(p) in SHARED_EXPERTS]
    if len(found.routers) != 1:
        found.reasons.append(
            f"experts {path} need exactly one router module beside them named one of "
            f"{', '.join(sorted(ROUTERS))} (found: {', '.join(found.routers) or 'none'})"
        )


def _find_mlp(modules: dict[str, nn.Module], found: _Found) -> None:
    def outside(path: str) -> bool:
        if found.attention is not None and _under(path, found.attention):
            return False
        taken = [*found.experts, *found.shared, *found.routers, *filter(None, [found.experts_module])]
        return not any(_under(path, other) for other in taken)

    candidates = {p: m for p, m in modules.items() if p and outside(p)}
    up = [p for p in candidates if _leaf(p) in MLP_UP]
    down = [p for p in candidates if _leaf(p) in MLP_DOWN]
    if not up and not down:
        if found.moe is None:
            found.reasons.append(
                "no MLP projections (named one of "
                f"{', '.join(sorted(MLP_UP | MLP_DOWN))}) and no experts module"
            )
        return
    parents = sorted({_parent(p) for p in up + down})
    if not up or not down or len(parents) != 1:
        found.reasons.append(
            f"MLP projections do not form one MLP: up {', '.join(up) or 'none'}, down "
            f"{', '.join(down) or 'none'}"
        )
        return
    found.mlp_up, found.mlp_down = up, down
    found.mlp_act = [p for p in candidates if _parent(p) == parents[0] and _leaf(p) in MLP_ACT]


def _find_norms(modules: dict[str, nn.Module], found: _Found) -> None:
    owned = [found.attention, found.moe, *found.mlp_up, *found.mlp_down]
    mlp_parent = _parent(found.mlp_up[0]) if found.mlp_up else None
    for path, module in modules.items():
        if not path or _children(module) or not is_norm(path, module):
            continue
        if found.attention and _under(path, found.attention):
            continue  # query/key norms, found with the attention
        if any(o and _under(path, o) for o in owned) or (mlp_parent and _under(path, mlp_parent)):
            continue
        role = norm_role(_leaf(path))
        if role is not None:
            found.norms.setdefault(role, []).append(path)
    norms = found.norms
    # "post_attention_layernorm" is the norm before the MLP in Llama-style layers; it is a
    # post-norm only where the layer has its own pre-MLP norm (Gemma 2/3) or no pre-attention
    # norm at all (OLMo 2's post-norm layers).
    if "post_attn" in norms and "pre_attn" in norms and "pre_mlp" not in norms:
        norms["pre_mlp"] = norms.pop("post_attn")


def _children(module: nn.Module) -> bool:
    return any(True for _ in module.children())


def derive_layout(layer: nn.Module) -> Derivation:
    """The units of ``layer`` derived from its submodule names and nesting.

    Unsure (``reasons`` not empty) when the attention, the MLP or the MoE block cannot be
    told apart without guessing: several candidates, a missing output projection or router,
    a layer with neither an MLP nor experts, an attention-free layer.
    """
    modules = dict(layer.named_modules())
    found = _Found()
    _find_attention(modules, found)
    _find_moe(modules, found)
    _find_mlp(modules, found)
    _find_norms(modules, found)

    units: dict[RecomputeUnit, list[Span]] = {}
    norms = found.norms
    if norms.get("pre_attn"):
        units[RecomputeUnit.ATTN_NORM] = norms["pre_attn"]
    if found.attention is not None and found.output is not None:
        units[RecomputeUnit.QKV_PROJ] = found.inputs
        if found.qk_norms:
            units[RecomputeUnit.QK_NORM] = found.qk_norms
        if found.rope:
            units[RecomputeUnit.ROPE] = found.rope
        # RoPE, the attention kernel and the reshapes around them have no module: the span
        # runs from the last input projection's exit to the output projection's entry.
        units[RecomputeUnit.ATTN_CORE] = [(f"{found.attention}:{PROJECTED}", f"{found.output}:enter")]
        units[RecomputeUnit.ATTN_PROJ] = [found.output]
    if norms.get("post_attn"):
        units[RecomputeUnit.ATTN_POST_NORM] = norms["post_attn"]
    if norms.get("pre_mlp"):
        units[RecomputeUnit.MLP_NORM] = norms["pre_mlp"]
    if found.mlp_up:
        units[RecomputeUnit.MLP_UP] = found.mlp_up
        if found.mlp_act:
            units[RecomputeUnit.MLP_ACT] = found.mlp_act
        units[RecomputeUnit.MLP_DOWN] = found.mlp_down
    if found.experts:
        if found.routers:
            units[RecomputeUnit.MOE_ROUTER] = found.routers
        if found.dispatch:
            units[RecomputeUnit.MOE_DISPATCH] = found.dispatch
        units[RecomputeUnit.MOE_EXPERTS] = found.experts
        if found.combine:
            units[RecomputeUnit.MOE_COMBINE] = found.combine
        if found.shared:
            units[RecomputeUnit.SHARED_EXPERTS] = found.shared
    if norms.get("post_mlp"):
        units[RecomputeUnit.MLP_POST_NORM] = norms["post_mlp"]
    return Derivation(units, tuple(found.reasons))


def submodule_names(layer: nn.Module, depth: int = 3) -> list[str]:
    """The submodule paths of ``layer`` down to ``depth`` levels, for error messages."""
    return [p for p, _ in layer.named_modules() if p and p.count(".") < depth]
