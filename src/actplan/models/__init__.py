"""Reference models and the name -> model registry the CLI and bench use.

Each entry builds a model, a batch maker and, where the model can state it, the
analytic activation floor. Models import only ``actplan.markers`` and
``actplan.units``; nothing in the engine imports this package.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from actplan.models import dense, moe, mtp, sparse
from actplan.models.shape import Shape, hf_config_values


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: the output itself, or its ``"loss"`` entry (a dict, or a
    Hugging Face ``ModelOutput``)."""
    return output["loss"] if isinstance(output, Mapping) else output


def train_step(
    model: nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    seed: int | None = None,
    context: contextlib.AbstractContextManager[Any] | None = None,
    after_forward: Callable[[torch.Tensor], Any] | None = None,
    after_backward: Callable[[torch.Tensor], Any] | None = None,
) -> torch.Tensor:
    """One training step, the way every measurement in actplan runs it: seed the RNG (when
    ``seed`` is given), forward keeping only the loss (other outputs would stay alive),
    backward, then the optimizer step and ``zero_grad(set_to_none=True)``.

    ``context`` is entered around forward and backward (a meter, a recorder);
    ``after_forward(loss)`` runs between them, ``after_backward(loss)`` before the optimizer
    step (while the gradients exist). Returns the loss.
    """
    if seed is not None:
        torch.manual_seed(seed)
    with context if context is not None else contextlib.nullcontext():
        loss = loss_of(model(**batch))
        if after_forward is not None:
            after_forward(loss)
        loss.backward()
        if after_backward is not None:
            after_backward(loss)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


@dataclass
class ModelBundle:
    """A model ready to train: ``model(**make_batch(seed))["loss"]`` is a scalar loss."""

    name: str
    size: str
    model: nn.Module
    make_batch: Callable[[int], dict[str, Any]]
    description: str

    def batch(self, seed: int = 0, device: torch.device | str | None = None) -> dict[str, Any]:
        """``make_batch(seed)`` with its tensors moved to ``device``; other values (flags,
        lists, a cache object) are passed through as they are."""
        made = self.make_batch(seed)
        if device is None:
            return made
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in made.items()}

    def activation_floor_bytes(self, batch: dict[str, torch.Tensor]) -> int | None:
        floor = getattr(self.model, "activation_floor_bytes", None)
        return floor(batch) if callable(floor) else None


def _describe(name: str, c) -> str:
    shape = f"dim {c.dim}, vocab {c.vocab_size}, batch {c.batch_size}x{c.seq_len}"
    if name == "moe":
        return (
            f"{c.n_layers} layers ({c.first_k_dense} dense), {c.n_experts} experts top-{c.top_k} "
            f"(ffn {c.expert_ffn_dim}), shared expert {c.shared_expert_ffn_dim}, {c.router} router, {shape}"
        )
    if name == "mtp":
        return f"{c.n_layers} layers + {c.mtp_depths} prediction depths, {shape}"
    if name == "sparse":
        return f"{c.n_layers} layers, indexer every {c.index_every} (top-{c.index_topk} keys), {shape}"
    return f"{c.n_layers} layers, {c.n_heads} heads ({c.n_kv_heads} kv), ffn {c.ffn_dim}, {shape}"


MODELS: dict[str, ModuleType] = {"dense": dense, "moe": moe, "mtp": mtp, "sparse": sparse}
"""Built-in models by name; each module has ``PRESETS``, ``build`` and ``make_batch``."""


def build_model(name: str = "dense", size: str = "small", **overrides) -> ModelBundle:
    """Build a reference model by name and size (``tiny`` for tests, ``small`` for the bench)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")
    module = MODELS[name]
    if size not in module.PRESETS:
        raise ValueError(f"model {name!r} has no size {size!r}; sizes: {', '.join(module.PRESETS)}")
    model, config = module.build(size, **overrides)
    return ModelBundle(
        name=name,
        size=size,
        model=model,
        make_batch=functools.partial(module.make_batch, config),
        description=f"{name} {size}: {_describe(name, config)}",
    )


def build_for_shape(shape: Shape, ep_group: Any = None, tp_mesh: Any = None) -> ModelBundle:
    """The model a real-scale estimate steps for ``shape``, in the current default dtype and
    device: transformers' own class when the shape came from a ``config.json`` (its code: how
    its norms cast, its RoPE, its attention, its loss), torchtitan's own model for
    ``shape.titan`` (split by torchtitan's own tensor parallelism over ``tp_mesh`` when one is
    given), else the reference model; a MoE reference model splits its experts over
    ``ep_group`` (a process group) when one is given."""
    if ep_group is not None:
        if shape.model != "moe" or shape.hf_config is not None or shape.titan is not None:
            raise ValueError(
                f"expert parallelism over a process group needs the MoE reference model; {shape.name} "
                f"runs {shape.code}"
            )
        return build_model(shape.model, "small", ep_group=ep_group, **shape.model_overrides())
    if tp_mesh is not None and shape.titan is None:
        raise ValueError(
            f"a model built split over a tensor-parallel mesh is torchtitan's (--titan); {shape.name} "
            "is split by actplan.parallelize's plan instead"
        )
    if shape.titan is not None:
        from actplan.models.titan import titan_model

        model, make_batch, description = titan_model(shape, tp_mesh)
        return ModelBundle("titan", "custom", model, make_batch, description)
    if shape.hf_config is None:
        return build_model(shape.model, "small", **shape.model_overrides())
    from actplan.models.hf import config_model

    values, added = hf_config_values(shape)
    model, make_batch, description = config_model(values, shape.seq, shape.batch, added)
    return ModelBundle("hf-config", "custom", model, make_batch, f"{description} ({shape.hf_config})")


def load_model(spec: str, size: str = "small") -> ModelBundle:
    """A built-in model by name, ``hf-<kind>`` (a random-weight ``transformers`` model of a
    supported architecture), or a user model given as ``package.module:factory``.

    The module is imported with the working directory on ``sys.path``. The factory is called
    with no arguments and returns either a ``ModelBundle`` or a pair
    ``(model, make_batch)``: ``make_batch(seed)`` returns the keyword arguments of one
    training step, and ``model(**make_batch(seed))`` returns the loss (a scalar tensor, or a
    dict with a ``"loss"`` entry). Its checkpointable layers are the modules whose class
    declares ``recompute_intervals``.
    """
    if spec in MODELS:
        return build_model(spec, size)
    if spec.startswith("hf-"):
        from actplan.models.hf import reference_model

        model, make_batch = reference_model(spec[3:], size)
        return ModelBundle(spec, size, model, make_batch, f"{spec} {size} (transformers, random weights)")
    if ":" not in spec:
        from actplan.models.hf import REFERENCE_KINDS

        raise ValueError(
            f"unknown model {spec!r}: give a built-in name ({', '.join(MODELS)}), a Hugging Face "
            f"reference ({', '.join(f'hf-{kind}' for kind in REFERENCE_KINDS)}) or a factory as "
            "'package.module:function'"
        )
    module_name, _, attribute = spec.partition(":")
    # As `python -m` does: modules in the working directory are importable.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {module_name!r} for model {spec!r}: {err}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attribute!r} (model {spec!r})")
    try:
        made = factory()
    except Exception as err:
        # Keep the factory's own traceback (chained below) and say which --model it was.
        raise RuntimeError(
            f"model factory {spec!r} raised {type(err).__name__}: {err} (its traceback is above)"
        ) from err
    if isinstance(made, ModelBundle):
        return made
    if not (
        isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and callable(made[1])
    ):
        raise ValueError(
            f"model factory {spec!r} returned {type(made).__name__}; return a ModelBundle or a pair "
            "(model, make_batch) where make_batch(seed) gives the model's keyword arguments"
        )
    model, make_batch = made
    return ModelBundle(name=spec, size="custom", model=model, make_batch=make_batch, description=spec)
