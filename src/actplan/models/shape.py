"""Real-scale decoder shapes: ``Shape`` (what ``actplan estimate`` builds: the reference dense
or MoE model at any size), the shapes shipped as ``models/shapes/*.yaml`` (each with its
source), a shape read from a Hugging Face ``config.json``, and the shape one rank of a
tensor- and expert-parallel layout builds (``Shape.per_rank``).

Imports torch (dtypes) and PyYAML; nothing from the engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

__all__ = ["DTYPES", "Shape", "hf_config_values", "load_shape", "shape_from_hf_config", "shape_names"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_ffn", "first_k_dense", "router")
# Multi-head latent attention (DeepSeek-V2/V3): the reference config's fields, same names.
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class Shape:
    """A decoder's shape and one GPU's batch: what the estimate builds (``model``: the reference
    model, ``dense`` or ``moe``). ``batch`` is per GPU. ``head_dim`` apart from hidden/heads
    (Qwen3). ``kv_lora_rank`` (with ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``
    and optionally ``q_lora_rank``) makes the attention multi-head latent attention (DeepSeek),
    whose keys and values have a head each (``kv_heads`` is not used). ``router``: ``softmax``
    (the default) or ``sigmoid`` scores. ``tp`` and ``ep`` are set by ``per_rank``: the layout
    this rank's shape is one of."""

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
    head_dim: int | None = None
    experts: int | None = None
    top_k: int | None = None
    expert_ffn: int | None = None
    shared_ffn: int | None = None
    first_k_dense: int | None = None
    router: str | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    tp: int = 1
    ep: int = 1
    name: str = "custom"
    # A Hugging Face config.json: the measured steps build transformers' own model class from
    # it (with this shape's numbers), not the reference model.
    hf_config: str | None = None
    # torchtitan's MODEL:FLAVOR (``llama3:8B``): the measured steps build torchtitan's own model.
    titan: str | None = None

    def check(self) -> None:
        """Raise ``ValueError`` naming the numbers that do not fit together."""
        if self.model not in ("dense", "moe"):
            raise ValueError(f"model {self.model!r}: the estimate builds 'dense' or 'moe'")
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.mla or any(getattr(self, name) is not None for name in _MLA_FIELDS):
            self._check_mla()
        elif self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden}), or give --head-dim")
        elif self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        elif self.attention_head_dim % 2:
            raise ValueError(f"head size {self.attention_head_dim} must be even (RoPE)")
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
            if self.router not in (None, "softmax", "sigmoid"):
                raise ValueError(f"router {self.router!r}: choose 'softmax' or 'sigmoid'")

    def _check_mla(self) -> None:
        missing = [name for name in _MLA_FIELDS[1:] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"multi-head latent attention needs {', '.join(missing)} as well")
        given = {name: getattr(self, name) for name in _MLA_FIELDS if getattr(self, name) is not None}
        wrong = [f"{name} ({value})" for name, value in given.items() if value < 1]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} must be positive")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.v_head_dim > qk:
            raise ValueError(
                f"v_head_dim ({self.v_head_dim}) must be at most qk_nope_head_dim + qk_rope_head_dim ({qk})"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE)")
        if self.head_dim is not None:
            raise ValueError(
                "head_dim does not apply to multi-head latent attention: qk_nope_head_dim + "
                "qk_rope_head_dim size its query and key heads, v_head_dim its value heads"
            )

    @property
    def mla(self) -> bool:
        """Whether the attention is multi-head latent attention."""
        return bool(self.kv_lora_rank)

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def per_rank(self, tp: int = 1, ep: int = 1) -> Shape:
        """The shape one rank builds under tensor parallelism over ``tp`` ranks (heads, KV heads,
        the dense and shared-expert FFN and the vocabulary split ``tp`` ways, as column- and
        row-parallel linears and a vocabulary-parallel loss split them) and expert parallelism
        over ``ep`` ranks (each holds experts/ep experts). Raises ``ValueError`` naming what
        does not divide.

        Multi-head latent attention splits its heads ``tp`` ways too (the up projections
        ``q_b_proj`` and ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel); the down
        projections to the latents, the rotary key part and the latents' norms are replicated,
        whole, on every rank, as torchtitan's DeepSeek-V3 tensor-parallel plan leaves them."""
        self.check()
        if tp < 1 or ep < 1:
            raise ValueError(f"--tp and --ep must be 1 or more, got tp={tp}, ep={ep}")
        if self.tp != 1 or self.ep != 1:
            raise ValueError(f"{self.name} is already one rank's shape (tp={self.tp}, ep={self.ep})")
        split = {"heads": self.heads, "kv_heads": self.heads if self.mla else self.kv_heads}
        split |= {"ffn": self.ffn, "vocab": self.vocab}
        if self.shared_ffn:
            split["shared_ffn"] = self.shared_ffn
        wrong = [f"{name} ({value})" for name, value in split.items() if value % tp]
        if wrong:
            raise ValueError(f"--tp {tp} must divide {', '.join(wrong)}; choose a --tp that divides them")
        if ep > 1 and self.model != "moe":
            raise ValueError(f"--ep {ep} needs a MoE shape; {self.name} is dense")
        if ep > 1 and self.experts % ep:
            raise ValueError(f"--ep {ep} must divide experts ({self.experts}); choose a divisor")
        divided = {name: value // tp for name, value in split.items()}
        head_dim = None if self.mla else self.attention_head_dim
        return replace(self, **divided, head_dim=head_dim, tp=tp, ep=ep)

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
        if self.head_dim is not None:
            overrides["attn_head_dim"] = self.head_dim
        if self.mla:
            overrides |= {name: getattr(self, name) for name in _MLA_FIELDS}
            overrides["n_kv_heads"] = self.heads
        if self.model == "moe":
            names = {"experts": "n_experts", "top_k": "top_k", "expert_ffn": "expert_ffn_dim"}
            names |= {"shared_ffn": "shared_expert_ffn_dim", "first_k_dense": "first_k_dense"}
            names |= {"router": "router"}
            overrides |= {names[f]: getattr(self, f) for f in _MOE_FIELDS if getattr(self, f) is not None}
            if self.ep > 1:
                overrides["simulated_ep"] = self.ep
        return overrides

    def describe(self) -> str:
        own_size = self.head_dim and self.head_dim * self.heads * self.tp != self.hidden
        heads = f"{self.heads} heads" + (f" of {self.head_dim}" if own_size else "")
        if self.mla:
            q = f"q rank {self.q_lora_rank}, " if self.q_lora_rank else ""
            heads += (
                f" (latent attention: {q}kv rank {self.kv_lora_rank}, qk {self.qk_nope_head_dim}"
                f"+{self.qk_rope_head_dim}, v {self.v_head_dim})"
            )
        else:
            heads += f" ({self.kv_heads} KV)"
        text = (
            f"{self.name}: {self.model}, {self.layers} layers, hidden {self.hidden}, {heads}, "
            f"ffn {self.ffn}, vocab {self.vocab}"
        )
        if self.model == "moe":
            router = f", {self.router} router" if self.router else ""
            text += f", {self.experts} experts (top {self.top_k}, ffn {self.expert_ffn}{router})"
        if self.tp > 1 or self.ep > 1:
            text += f"; one rank of tp {self.tp} x ep {self.ep}"
        return text + f"; {self.batch} x {self.seq} tokens per GPU, {self.dtype}"

    @property
    def code(self) -> str:
        """Which model code the measured steps run."""
        if self.titan is not None:
            return f"torchtitan's own {self.titan} (SDPA standing in for FlexAttention)"
        if self.hf_config is None:
            return f"actplan's reference {self.model} decoder"
        return f"transformers' own class for {self.hf_config}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shape_names() -> list[str]:
    """The shapes shipped with actplan (``actplan/models/shapes/*.yaml``)."""
    folder = resources.files("actplan.models") / "shapes"
    return sorted(
        entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml")
    )


def _with_overrides(shape: Shape, overrides: dict[str, Any]) -> Shape:
    valid = {f.name for f in fields(Shape)}
    unknown = set(overrides) - valid
    if unknown:
        raise ValueError(f"unknown shape fields {sorted(unknown)}; known: {', '.join(sorted(valid))}")
    shape = replace(shape, **{k: v for k, v in overrides.items() if v is not None})
    shape.check()
    return shape


def load_shape(name: str, **overrides: Any) -> Shape:
    """A shipped shape by name, with ``overrides`` (``seq=4096``, ...) applied; checked."""
    known = shape_names()
    if name not in known:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(known)}")
    text = (resources.files("actplan.models") / "shapes" / f"{name}.yaml").read_text()
    data = yaml.safe_load(text)
    unknown = set(data) - {f.name for f in fields(Shape)}
    if unknown:
        raise ValueError(f"shape file {name}.yaml has unknown fields {sorted(unknown)}")
    return _with_overrides(Shape(**data, name=name), overrides)


# config.json keys, per Shape field, in the order the Hugging Face families use them.
_HF_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab": ("vocab_size",),
    "head_dim": ("head_dim",),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok", "moe_top_k"),
    "expert_ffn": ("moe_intermediate_size",),
    "shared_ffn": ("shared_expert_intermediate_size",),
    "first_k_dense": ("first_k_dense_replace",),
    "router": ("scoring_func",),
    **{name: (name,) for name in _MLA_FIELDS},
}
# Attention the reference models do not have: refused rather than estimated as something else.
_UNSUPPORTED = {
    "sliding_window_pattern": "interleaved sliding-window attention",
    "linear_attn_config": "linear attention",
}


def shape_from_hf_config(path: str | Path, **overrides: Any) -> Shape:
    """A shape from a Hugging Face ``config.json`` (a file, or a folder holding one; read
    locally, never downloaded), with ``overrides`` applied: its numbers (a Llama-, Mistral-,
    Qwen-, Mixtral- or DeepSeek-V2/V3-style decoder; anything else is refused with the reason)
    and the file itself (``hf_config``), from which the measured steps build transformers' own
    class; the formula path (expert parallelism) steps the reference dense or MoE model at
    these numbers. DeepSeek-V3's multi-token prediction module (``num_nextn_predict_layers``)
    is not laid out."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--hf-config {path}: no such file; give a local config.json (or its folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--hf-config {path}: not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--hf-config {path}: a config.json holds one JSON object")
    config = {**config.get("text_config", {}), **config}  # multimodal configs nest the decoder
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(
                f"--hf-config {path}: {config.get('model_type', 'this model')} uses {what}, which the "
                "reference models do not lay out; estimate a standard-attention shape with flags instead"
            )

    def first(name: str) -> Any:
        return next((config[k] for k in _HF_KEYS[name] if config.get(k) is not None), None)

    found = {name: first(name) for name in _HF_KEYS}
    missing = [name for name in ("layers", "hidden", "heads", "vocab") if found[name] is None]
    if missing or config.get("is_encoder_decoder"):
        raise ValueError(
            f"--hf-config {path}: not a decoder actplan can lay out (model_type "
            f"{config.get('model_type')!r}; missing {', '.join(_HF_KEYS[m][0] for m in missing) or 'none'}"
            f"{', encoder-decoder' if config.get('is_encoder_decoder') else ''})"
        )
    found["kv_heads"] = found["kv_heads"] or found["heads"]
    found["ffn"] = found["ffn"] or 4 * found["hidden"]
    if found["head_dim"] == found["hidden"] // found["heads"] or found["kv_lora_rank"]:
        found["head_dim"] = None  # MLA: transformers sets head_dim to qk_rope_head_dim
    if not found["kv_lora_rank"]:
        found |= dict.fromkeys(_MLA_FIELDS)
    moe = found["experts"] is not None and found["top_k"] is not None
    if moe:
        found["expert_ffn"] = found["expert_ffn"] or found["ffn"]
        shared = found["shared_ffn"]
        if shared is None and config.get("n_shared_experts"):
            shared = config["n_shared_experts"] * found["expert_ffn"]
        found["shared_ffn"] = shared or 0
        found["first_k_dense"] = found["first_k_dense"] or 0
    else:
        found = {k: v for k, v in found.items() if k not in _MOE_FIELDS}
    name = config.get("_name_or_path") or config.get("model_type") or path.parent.name
    shape = Shape(model="moe" if moe else "dense", name=str(name), hf_config=str(path), **found)
    return _with_overrides(shape, overrides)


_RUN_FIELDS = ("seq", "batch", "dtype", "tp", "ep", "name", "hf_config", "titan", "model")


def hf_config_values(shape: Shape) -> tuple[dict[str, Any], list[str]]:
    """``shape.hf_config``'s JSON with the shape's own numbers written into it where they differ
    from the file's (flags, a shallower profiled stack, one tensor-parallel rank's share): what
    transformers' model class is built from. Returns the values and the keys written that the
    file did not have (the builder checks its config class takes them, so none is dropped)."""
    if shape.hf_config is None:
        raise ValueError("this shape has no Hugging Face config")
    config = json.loads(Path(shape.hf_config).read_text())
    text = config.get("text_config")
    target = text if isinstance(text, dict) else config  # a multimodal config nests the decoder
    base = shape_from_hf_config(shape.hf_config)
    added = []
    for item in fields(Shape):
        name = item.name
        value = getattr(shape, name)
        if name in _RUN_FIELDS or value == getattr(base, name):
            continue
        keys = _HF_KEYS[name]
        key = next((k for k in keys if k in target), keys[0])
        if key not in target:
            added.append(key)
        target[key] = value
        if name == "layers":
            _relayer(target, base.layers, value)
    if target.get("head_dim") is not None and not shape.mla:
        target["head_dim"] = shape.attention_head_dim  # a stated head size follows --hidden, --heads
    return config, added


def _relayer(config: dict[str, Any], was: int, now: int) -> None:
    """Per-layer lists (``layer_types``, ...) fitted to a new layer count: cut short, or carried
    on by repeating their pattern, as a config for the same model at that depth would say."""
    for key, value in config.items():
        if isinstance(value, list) and len(value) == was and was > 0:
            config[key] = [value[index % was] for index in range(now)]
