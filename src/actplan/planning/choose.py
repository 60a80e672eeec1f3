"""From a solver's choices back to a config: the candidate each layer gets, the
``RecomputeConfig`` that installs exactly those candidates, and its ``made_for`` block (the
model, shape, dtype, device, budget and actplan version the plan was made for).

Imports ``actplan.config``, ``actplan._install`` (layer ranges, the model's layers) and the
planning records (a candidate's config entry, the profile types).
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from actplan._install.apply import find_layers, layer_specs
from actplan._install.plan import format_indices
from actplan._torch_internals import tree_leaves
from actplan.config import RecomputeConfig
from actplan.config._made_for import class_ranges
from actplan.planning._records import choice_of
from actplan.sizes import DEFAULT_HOST_CAP_BYTES

if TYPE_CHECKING:
    from actplan.models import ModelBundle
    from actplan.planning._records import CandidateProfile, ModelProfile


def picked(profile: ModelProfile, choices: list[int] | tuple[int, ...]) -> list[CandidateProfile]:
    """Per layer, the candidate ``choices`` picks for it."""
    return [profile.type_of(index).candidates[choice] for index, choice in enumerate(choices)]


def made_for(
    bundle: ModelBundle,
    spec: str,
    device: torch.device | str,
    budget: str | int | float | None = None,
    budget_bytes: float | None = None,
    layer_input: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The ``made_for`` block of a plan for ``bundle`` (loaded from ``spec``) on ``device``:
    model, size, layer count and classes, batch and sequence length (of the token ids, when
    the batch has them), the first layer's input shape (``layer_input``, else found by running
    the model up to its first layer), dtype, device, budget and actplan version."""
    classes = [layer.class_name for layer in layer_specs(bundle.model)]
    block: dict[str, Any] = {
        "model": spec,
        "size": None if bundle.size == "custom" else bundle.size,
        "layers": len(classes),
        "layer_classes": dict(class_ranges(classes)),
        **_batch_shape(bundle.batch(0)),
        "layer_input": list(
            layer_input or first_layer_input(bundle.model, bundle.batch(0, _home(bundle.model)))
        )
        or None,
        "dtype": _dtype(bundle.model),
        "device": str(device),
        "budget": None if budget is None else str(budget),
        "budget_bytes": None if budget_bytes is None else round(budget_bytes),
        "actplan_version": _version(),
    }
    return {key: value for key, value in block.items() if value is not None}


def _home(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the CPU for a model without any)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class _Reached(Exception):
    """Stops a forward at the first layer (``first_layer_input``)."""


def first_layer_input(model: torch.nn.Module, batch: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape of the first tensor the model's first checkpointable layer is called with (its
    hidden states), found by running ``model(**batch)`` without gradients up to that call (the
    random number generators as they were before); ``()`` when the layer gets no tensor."""
    (_, first), *_ = find_layers(model)
    cuda = [t.device for t in batch.values() if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    found: list[tuple[int, ...]] = []

    def stop(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        tensor = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        found.append(() if tensor is None else tuple(tensor.shape))
        raise _Reached

    handle = first.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda[:1]):
            model(**batch)
    except _Reached:
        pass
    finally:
        handle.remove()
    return found[0] if found else ()


def _batch_shape(batch: Mapping[str, Any]) -> dict[str, int]:
    """``{"batch": B, "seq": S}`` of the token ids (a 2-D integer tensor), else ``{}``."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() == 2), None)
    if ids is None or ids.dim() != 2 or ids.is_floating_point():
        return {}
    return {"batch": ids.shape[0], "seq": ids.shape[1]}


def _dtype(model: torch.nn.Module) -> str | None:
    """The dtype of the model's floating-point parameters (the first one's), e.g. ``'float32'``."""
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    return None if first is None else str(first.dtype).removeprefix("torch.")


def _version() -> str | None:
    try:
        return importlib.metadata.version("actplan")
    except importlib.metadata.PackageNotFoundError:
        return None


def host_cap_for(host_bytes: float) -> int | None:
    """The offload pool cap a plan moving ``host_bytes`` to the host needs, when the default
    (16 GiB) is too small: those bytes and an eighth more (the pool's size classes round each
    buffer up by less than that), in whole GiB."""
    needed = math.ceil(host_bytes * 9 / 8 / 2**30) * 2**30
    return needed if needed > DEFAULT_HOST_CAP_BYTES else None


def config_for(
    profile: ModelProfile,
    choices: list[int] | tuple[int, ...],
    made_for: Mapping[str, Any] | None = None,
) -> RecomputeConfig:
    """The ``RecomputeConfig`` that installs one candidate per layer: the most common choice at
    the top level, the others as overrides, offloaded layers in one offload block (its pool's
    cap raised when the default is too small, ``host_cap_for``); with ``made_for`` (see
    ``made_for``) as its header when given."""
    chosen = picked(profile, choices)
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for index, candidate in enumerate(chosen):
        groups.setdefault((candidate.mode, tuple(candidate.kept_units)), []).append(index)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    (top_mode, top_kept), _ = ordered[0]
    data: dict[str, Any] = {"made_for": dict(made_for)} if made_for is not None else {}
    data.update(choice_of(top_mode, top_kept))
    if len(ordered) > 1:
        data["overrides"] = [
            {"layers": format_indices(indices), **choice_of(mode, kept)}
            for (mode, kept), indices in ordered[1:]
        ]
    offloaded = [index for index, candidate in enumerate(chosen) if candidate.offload]
    if offloaded:
        data["offload"] = {
            "layers": format_indices(offloaded),
            "layer_input": True,
            "min_bytes": profile.min_bytes,
        }
        if any(chosen[i].kept_units for i in offloaded):
            data["offload"]["units"] = "kept"
        host_cap = host_cap_for(sum(candidate.offloaded_bytes for candidate in chosen))
        if host_cap is not None:
            data["offload"]["host_cap"] = host_cap
    return RecomputeConfig.from_dict(data, source="planner")
