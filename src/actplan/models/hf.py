"""Small random-weight Hugging Face ``transformers`` models of the supported architectures, for
the tests, ``actplan verify`` and the bench (``--model hf-<kind>``), and the model class a
user's ``config.json`` names, at any size, for the estimate (``config_model``). transformers is
imported only when one is built (the ``hf`` extra).

Imports nothing from actplan: the layouts that checkpoint these models live in
``actplan.integrations.hf``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

_REFERENCE_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024),
    # Activations dominate, as at long sequences (see the dense model's "long").
    "long": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024),
}  # fmt: skip
_BATCH = {"tiny": (2, 16), "small": (2, 256), "long": (2, 1024)}


def _moe(shapes: dict[str, int]) -> int:
    return shapes["intermediate_size"] // 4


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


# kind -> (config class, model class, extra config arguments from the shapes). Test fixtures,
# one per family the derivation is checked on: nothing else reads these class names.
_REFERENCE_MODELS: dict[str, tuple[str, str, Callable[[dict[str, int]], dict[str, Any]]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", lambda s: {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", lambda s: {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", lambda s: {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", lambda s: {"head_dim": 16}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", lambda s: {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": _moe(s),
        "mlp_only_layers": [0]}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", lambda s: {
        "n_embd": s["hidden_size"], "n_layer": s["num_hidden_layers"], "n_head": s["num_attention_heads"],
        "n_inner": s["intermediate_size"], "n_positions": s["max_position_embeddings"]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", lambda s: {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": _moe(s)}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", lambda s: {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": _moe(s),
        "shared_expert_intermediate_size": s["intermediate_size"] // 2}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", lambda s: {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
        "layer_types": _alternating(s["num_hidden_layers"])}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", lambda s: {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
        "layer_types": _alternating(s["num_hidden_layers"])}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", lambda s: {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", lambda s: {}),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", lambda s: {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": _moe(s),
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16}),
}  # fmt: skip
REFERENCE_KINDS = tuple(_REFERENCE_MODELS)


def reference_model(kind: str, size: str = "tiny", layers: int | None = None) -> tuple[nn.Module, Any]:
    """A randomly initialised ``transformers`` model of ``kind`` and a batch maker: what
    ``--model hf-<kind>`` runs (``layers`` overrides the size's layer count). Needs
    ``transformers`` (``pip install actplan[hf]``)."""
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
    shapes = dict(_REFERENCE_SHAPES[size])
    if layers is not None:
        shapes["num_hidden_layers"] = layers
    config_name, model_name, extra = _REFERENCE_MODELS[kind]
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        raise ValueError(
            f"hf-{kind} needs transformers.{config_name}, which transformers {transformers.__version__} "
            "does not have; upgrade transformers"
        )
    # Token ids inside the small vocabulary; no KV cache (see declare).
    arguments = {**shapes, "use_cache": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config_class(**{**arguments, **extra(shapes)}))
    rows, seq = _BATCH[size]
    vocab = shapes["vocab_size"]

    def make_batch(seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, :-1].contiguous()}

    return model.train(), make_batch


def config_model(
    values: dict[str, Any], seq: int, batch: int, added: Sequence[str] = ()
) -> tuple[nn.Module, Any, str]:
    """transformers' causal-LM class for a ``config.json``'s ``values``, built in the current
    default dtype and device (the estimate builds it on ``meta``), with SDPA attention and no
    KV cache, and a batch maker of ``batch`` x ``seq`` random token ids (labels the same ids:
    the model shifts them itself). ``added`` names keys set that the file did not have: each
    must be a field of the model type's config, or it would be silently ignored. Returns the
    model, the batch maker and a description."""
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError("--hf-config builds the transformers model: pip install 'actplan[hf]'") from None
    values = dict(values)
    model_type = values.pop("model_type", None)
    try:
        defaults = transformers.AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as error:
        raise ValueError(
            f"transformers {transformers.__version__} does not know model_type {model_type!r} ({error}); "
            "upgrade transformers, or estimate the shape with --model and its numbers"
        ) from None
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except Exception as error:  # transformers' config validation raises its own error types
        raise ValueError(f"transformers refuses this config for {model_type!r}: {error}") from None
    fields = defaults.get_text_config() if isinstance(values.get("text_config"), dict) else defaults
    ignored = [key for key in added if not hasattr(fields, key)]
    if ignored:
        raise ValueError(
            f"{type(config).__name__} has no {', '.join(ignored)}: a number set there would change "
            "nothing; edit a copy of the config.json instead"
        )
    config.use_cache = False
    try:
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.get_default_dtype()
        )
    except ValueError as error:
        raise ValueError(f"transformers has no causal-LM class for {model_type!r}: {error}") from None
    vocab = config.get_text_config().vocab_size

    def make_batch(seed: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "labels": ids}

    return model.train(), make_batch, f"transformers {type(model).__name__}"
