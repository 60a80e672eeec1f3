"""Compose actplan with FSDP2 and ``torch.compile``: ``parallelize(model, mesh, config)``.

The one place where the whole model transformation order is written out, top to
bottom, as torchtitan's ``parallelize`` functions do. It sits above ``apply``
(checkpoint wrappers) and beside the CLI; nothing in the engine imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from actplan._install.apply import apply, find_layers
from actplan._install.plan import Plan
from actplan.config import ConfigError, RecomputeConfig

__all__ = ["parallelize"]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    config: RecomputeConfig | dict[str, Any] | str | Path,
    *,
    compile: bool | Mapping[str, Any] = False,
    reshard_after_forward: bool = True,
) -> Plan:
    """Checkpoint, optionally compile, and FSDP2-shard ``model``; returns the installed plan.

    Per checkpointable layer (each module whose class declares
    ``recompute_intervals``, as ``actplan.find_layers`` finds them), in this order:

    1. the actplan checkpoint wrapper the plan asks for (``actplan.apply``;
       layers whose plan is ``none`` stay unwrapped);
    2. ``layer.compile(fullgraph=True)`` when ``compile`` is set;
    3. ``fully_shard(layer, mesh=mesh, reshard_after_forward=...)``;

    then ``fully_shard(model, mesh=mesh)`` on the root, last, so the root's group
    holds whatever no layer owns (embeddings, final norm, head); FSDP keeps the
    root's parameters unsharded after forward, since backward starts with them.

    Why this order: the checkpoint wrapper is an instance-level ``forward``, and
    FSDP's all-gather / reshard hooks are module hooks around ``forward``. The
    replay in backward calls the layer's class ``forward`` directly, never the
    module, so recompute never re-fires FSDP's pre-forward unshard (nor any other
    hook on the layer): backward issues the same all-gathers as without
    checkpointing. Compiling before
    sharding lets dynamo see the checkpointed forward as one graph while FSDP's
    hooks stay outside it.

    Expert parallelism: a model built with an expert-parallel group (for example
    ``moe.build(size, ep_group=group)``) holds different experts on different
    ranks, in modules that expose ``expert_parallel_group``. Their weights are
    left out of FSDP (no other rank holds them to shard or average with: the
    expert-parallel group must span every rank for now), and their gradients,
    which the all-to-all backward sums over all ranks' tokens, are divided by the
    world size so they match FSDP's averaged ones. They are not put in FSDP
    groups of their own either: such a group's unshard would run inside the
    checkpointed layer, where the replay would meet it. Expert-parallel layers
    cannot be compiled yet (their per-expert splits are data-dependent).

    Args:
        model: the model, unsharded, with its parameters already on the mesh's
            device type. Changed in place.
        mesh: a 1-D ``DeviceMesh`` (``init_device_mesh("cuda", (world_size,))``)
            over which every group is fully sharded. HSDP (2-D) is not supported
            yet.
        config: a ``RecomputeConfig``, a dict, a preset name or a YAML/JSON
            path, as ``actplan.apply`` takes it. A bad config raises
            ``ConfigError`` before the model is touched.
        compile: ``True`` to compile each checkpointable layer with
            ``torch.compile(fullgraph=True)``; a mapping of further
            ``torch.compile`` keyword arguments (``{"backend": "aot_eager"}``)
            does the same with them. ``fullgraph`` is always ``True``: a graph
            break inside a checkpointed layer would split the marker stream
            the policy follows.
        reshard_after_forward: passed to each layer's ``fully_shard``. ``True``
            frees unsharded parameters after each layer's forward and
            all-gathers them again in backward; ``False`` keeps them.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``mesh`` not a ``DeviceMesh``.
        ValueError: ``mesh`` is not 1-D, ``compile`` sets ``fullgraph=False``,
            the model (or part of it) is already sharded by ``fully_shard``, or
            a layer is already compiled.
        ConfigError: the config is malformed or does not fit the model, or it
            offloads while ``compile`` is set (offload is eager-only).
    """
    compile_options = _compile_options(compile)
    if compile_options is not None:
        _reject_compiled_offload(config)
    _check_inputs(model, mesh)
    expert_params = _expert_parallel_params(model, mesh, compile_options is not None)

    # apply resolves the config before touching the model: a bad one changes nothing.
    plan = apply(model, config)
    for _, layer in find_layers(model):
        if compile_options is not None:
            layer.compile(**compile_options)
        if layer is not model:  # a model that is itself one layer is sharded once, as the root
            fully_shard(
                layer,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                ignored_params={p for p in layer.parameters() if p in expert_params} or None,
            )
    # The root keeps FSDP's default: not resharded after forward, as backward starts with its head.
    fully_shard(model, mesh=mesh, ignored_params=expert_params or None)
    world = mesh.size()
    for param in expert_params:
        # The all-to-all backward summed every rank's tokens into it; FSDP averages the rest.
        param.register_hook(lambda grad: grad / world)
    return plan


def _reject_compiled_offload(config: RecomputeConfig | dict[str, Any] | str | Path) -> None:
    try:
        parsed = RecomputeConfig.parse(config)
    except ConfigError:
        return  # apply reports it, with the model's units
    if parsed.offload is not None:
        raise ConfigError(
            "offload runs in eager mode only, and parallelize was asked to compile the layers; "
            "remove `offload` from the config or call parallelize with compile=False"
        )


def _expert_parallel_params(model: nn.Module, mesh: DeviceMesh, compiling: bool) -> set[nn.Parameter]:
    """Parameters of modules that hold this rank's own experts (checked against the mesh)."""
    expert_modules = [m for m in model.modules() if getattr(m, "expert_parallel_group", None) is not None]
    if not expert_modules:
        return set()
    if compiling:
        raise ValueError(
            "expert-parallel layers cannot be compiled with fullgraph=True yet: their per-expert "
            "token splits are data-dependent; call parallelize with compile=False"
        )
    groups = {id(m.expert_parallel_group): m.expert_parallel_group for m in expert_modules}
    if len(groups) != 1:
        raise ValueError("every expert-parallel module must use the same expert-parallel process group")
    group = next(iter(groups.values()))
    ep_size, world = dist.get_world_size(group), dist.get_world_size()
    if mesh.size() != world or ep_size != world:
        raise ValueError(
            f"parallelize supports expert parallelism over every rank for now: the FSDP mesh has "
            f"{mesh.size()} ranks and the expert-parallel group {ep_size}, of {world} in all (experts "
            "replicated over data-parallel groups would need averaging that is not there yet); build the "
            "model with an ep_group and a mesh covering all ranks"
        )
    return {p for m in expert_modules for p in m.parameters()}


def _compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    if compile is False:
        return None
    if compile is True:
        return {"fullgraph": True}
    if not isinstance(compile, Mapping):
        raise TypeError(
            f"compile must be a bool or a mapping of torch.compile options, got {type(compile).__name__}"
        )
    if compile.get("fullgraph", True) is not True:
        raise ValueError(
            "parallelize compiles each layer with fullgraph=True: a graph break would split the "
            "checkpointed region; drop 'fullgraph' from the compile options"
        )
    return {**compile, "fullgraph": True}


def _check_inputs(model: nn.Module, mesh: DeviceMesh) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}; build one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize supports a 1-D mesh (plain FSDP) for now, got a {mesh.ndim}-D mesh with "
            f"dimensions {mesh.mesh_dim_names or tuple(mesh.shape)}; pass the data-parallel "
            "sub-mesh, e.g. mesh['dp']"
        )
    sharded = [name or "<root>" for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if sharded:
        raise ValueError(
            f"the model is already sharded by fully_shard ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}); call parallelize on the unsharded model: "
            "it applies checkpointing before fully_shard so FSDP's hooks stay outside the replay"
        )
    compiled = [name for name, m in find_layers(model) if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise ValueError(
            f"layer {compiled[0]} is already compiled; pass compile=True to parallelize instead, so "
            "the checkpoint wrapper is installed before compilation"
        )
