"""Compose actplan with tensor parallelism, FSDP2 and ``torch.compile``:
``parallelize(model, mesh, config)``.

The one place where the whole model transformation order is written out, top to
bottom, as torchtitan's ``parallelize`` functions do: tensor/sequence parallelism, the
checkpoint wrapper, compile, ``fully_shard``. It sits above ``apply`` (checkpoint wrappers)
and beside the CLI; nothing in the engine imports it. ``tensor_parallelize`` is the first
step alone, for code that writes the others itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from actplan import integrations
from actplan._install.apply import _with_saved_layouts, apply, find_layers, plan_for
from actplan._install.plan import Plan
from actplan._install.tensor_parallel import (
    TPPlanArg,
    apply_tp_plan,
    reject_tensor_parallel,
    resolve_tp_plan,
    tensor_parallel_plan,
    tensor_parallelize,
)
from actplan._torch_internals import compile_module_under, is_compiled_module, layer_compile_flags
from actplan.config import ConfigError, RecomputeConfig

__all__ = ["expert_parallel_mesh", "parallelize", "tensor_parallel_plan", "tensor_parallelize"]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    config: RecomputeConfig | dict[str, Any] | str | Path,
    *,
    tp_plan: TPPlanArg = "auto",
    sequence_parallel: bool | None = None,
    compile: bool | Mapping[str, Any] = False,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Plan:
    """Tensor-parallelise, checkpoint, optionally compile, and FSDP2-shard ``model``; returns
    the installed plan.

    ``mesh`` says which parallelism runs over which ranks: a 1-D mesh is FSDP over all of
    them (as before); a 2-D mesh with dimensions ``("dp", "tp")``
    (``init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))``) is tensor
    parallelism inside each group of ``tp`` neighbouring ranks and FSDP over ``dp``; a 1-D
    mesh named ``("tp",)`` is tensor parallelism alone.

    In this order, as torchtitan composes them:

    1. tensor (and sequence) parallelism over ``mesh["tp"]`` (``tensor_parallelize``):
       DTensor weights and the module hooks that move activations between layouts;
    2. per checkpointable layer (each module whose class declares ``recompute_intervals``,
       as ``actplan.lowlevel.find_layers`` finds them), the actplan checkpoint wrapper the plan asks
       for (``actplan.apply``; layers whose plan is ``none`` stay unwrapped);
    3. ``layer.compile(fullgraph=True)`` when ``compile`` is set;
    4. ``fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=...)``;

    then ``fully_shard(model, mesh=mesh["dp"])`` on the root, last, so the root's group
    holds whatever no layer owns (embeddings, final norm, head); FSDP keeps the
    root's parameters unsharded after forward, since backward starts with them.

    Why this order: the checkpoint wrapper is an instance-level ``forward``, and
    FSDP's all-gather / reshard hooks are module hooks around ``forward``. The
    replay in backward calls the layer's class ``forward`` directly, never the
    module, so recompute never re-fires FSDP's pre-forward unshard (nor any other
    hook on the layer): backward issues the same all-gathers as without
    checkpointing. Tensor parallelism's hooks sit on the layer's submodules, inside the
    checkpointed forward: its all-gathers and reduce-scatters are collectives like any
    other, held by a kept interval and by every selective plan, never replayed. Compiling
    before sharding lets dynamo see the checkpointed forward as one graph while FSDP's
    hooks stay outside it.

    Expert parallelism: a model built with an expert-parallel group (for example
    ``moe.build(size, ep_group=group)``) holds different experts on different
    ranks, in modules that expose ``expert_parallel_group``. Each expert's gradient, which the
    all-to-all backward sums over the tokens of every rank of the group, is averaged with the
    rest: divided by the data-parallel degree times the tensor-parallel ranks that route the
    same tokens (all of them without sequence parallelism, where each rank of a
    tensor-parallel group sends the same tokens; one with it, where each routes its own
    sequence shard and the experts' ``token_shards`` says so).

    - A group over every rank: each expert lives on one rank only, so its weights are left out
      of FSDP and a hook divides its gradient.
    - A group over ``ep`` of the ranks of a 1-D or ``("dp", "tp")`` mesh (``ep`` dividing the
      world size, laid out as ``init_device_mesh(device, (world // ep, ep),
      mesh_dim_names=(..., "ep"))["ep"]`` lays them out, consecutive ranks): the ``world // ep``
      ranks that hold the same experts shard them with FSDP, in a group of their own inside
      each layer (torchtitan's layout), reduce-scattered with the same divide factor. Their
      unshard and reshard run inside the checkpointed
      layer, as FSDP's own work: the engine steps aside for those hooks, so FSDP does in the
      replay what it does under ``torch.utils.checkpoint``.

    Compiled, an expert-parallel layer's all-to-all splits become symbolic sizes in its one
    graph (experts over every rank only: FSDP's hooks inside a layer break its graph).

    Args:
        model: the model, unsharded, with its parameters already on the mesh's
            device type. Changed in place.
        mesh: a 1-D ``DeviceMesh`` (FSDP over every rank; ``("tp",)``-named: tensor
            parallelism alone) or a 2-D one named ``("dp", "tp")``. HSDP is not supported yet.
        config: a ``RecomputeConfig``, a dict, a preset name or a YAML/JSON
            path, as ``actplan.apply`` takes it. A bad config raises
            ``ConfigError`` before the model is touched.
        tp_plan: with a ``"tp"`` mesh dimension, how to split the model: ``"auto"`` (the
            default) takes the model's own ``tensor_parallel_plan`` (the reference models)
            or the built-in plan for Llama-style Hugging Face decoders
            (``tensor_parallel_plan``); a mapping of module names (``*`` matches one name
            part, as ``parallelize_module`` takes them) to a ``ParallelStyle`` or a sequence
            of them, applied in order; ``None`` when the model is already tensor-parallel
            (you applied the styles yourself, before this call). Ignored without a ``"tp"``
            dimension, where only ``"auto"`` is accepted.
        sequence_parallel: for ``tp_plan="auto"``: keep the residual stream split along the
            sequence between layers (norms on sequence shards, all-gather before the colwise
            projections, reduce-scatter after the rowwise ones). ``None``: the model's
            default (on for the dense reference model and Hugging Face decoders, off for
            the MoE reference model, whose routed experts it needs split by expert
            parallelism: each tensor-parallel rank then routes its own sequence shard).
        compile: ``True`` to compile each checkpointable layer with
            ``torch.compile(fullgraph=True)``; a mapping of further
            ``torch.compile`` keyword arguments (``{"backend": "aot_eager"}``)
            does the same with them. ``fullgraph`` is always ``True``: a graph
            break inside a checkpointed layer would split the marker stream
            the policy follows.
        reshard_after_forward: passed to each layer's ``fully_shard``. ``True``
            frees unsharded parameters after each layer's forward and
            all-gathers them again in backward; ``False`` keeps them.
        mp_policy: FSDP2's mixed precision, passed to every ``fully_shard``
            (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)`` is torchtitan's bf16 training); ``None`` keeps
            FSDP's default, parameters and reductions in their own dtype.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``mesh`` not a ``DeviceMesh``.
        ValueError: ``mesh`` is neither 1-D nor 2-D ``("dp", "tp")``, ``compile`` sets
            ``fullgraph=False``, the model (or part of it) is already sharded by
            ``fully_shard``, a layer is already compiled, the model is already
            tensor-parallel while ``tp_plan`` asks to split it, or the tensor-parallel plan
            does not fit the model (no plan for it, sizes that do not divide).
        ConfigError: the config is malformed or does not fit the model, or it
            offloads while ``compile`` is set (offload is eager-only).
    """
    compile_options = _compile_options(compile)
    if compile_options is not None:
        _reject_compiled_offload(config)
    dp_mesh, tp_mesh = _check_inputs(model, mesh, tp_plan, sequence_parallel)
    experts = _expert_parallel(model, mesh, mp_policy, compile_options is not None)
    styles = None
    if tp_mesh is not None and tp_plan is not None:
        styles = resolve_tp_plan(model, tp_mesh, tp_plan, sequence_parallel)
    if styles is not None:
        # A bad config raises here, before tensor parallelism changes the model.
        plan_for(model, config, _with_saved_layouts(model, integrations.recognising(model), None))
        apply_tp_plan(model, tp_mesh, styles)
    plan = apply(model, config)
    sharding = {} if dp_mesh is None else _sharding(dp_mesh.size(), mp_policy)
    for _, layer in find_layers(model):
        if compile_options is not None:
            # MoE layers' per-expert splits are data-dependent sizes, and third-party layers
            # may set and reset a global: dynamo traces both into the one graph under these
            # flags (set for these layers' calls only).
            compile_module_under(layer, compile_options, layer_compile_flags)
        if dp_mesh is not None and layer is not model:
            experts.shard_inside(layer, reshard_after_forward, mp_policy)
            # a model that is itself one layer is sharded once, as the root
            fully_shard(
                layer,
                mesh=dp_mesh,
                reshard_after_forward=reshard_after_forward,
                ignored_params={p for p in layer.parameters() if p in experts.unsharded} or None,
                **sharding,
            )
    if dp_mesh is not None:
        # The root keeps FSDP's default: not resharded after forward, as backward starts with its head.
        fully_shard(model, mesh=dp_mesh, ignored_params=experts.unsharded or None, **sharding)
    experts.average_unsharded()  # the all-to-all's backward summed every rank's tokens into them
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


class _Experts:
    """Where a model's expert-parallel modules go: left out of FSDP (``unsharded``, their
    group spans every rank) or sharded in groups of their own over ``mesh`` (the ranks that
    hold the same experts); and what their gradients are divided by."""

    def __init__(self, modules: list[nn.Module], mesh: DeviceMesh | None, world: int, tp: int = 1) -> None:
        self.modules, self.mesh, self.world, self.tp = modules, mesh, world, tp
        self.unsharded = {p for m in modules for p in m.parameters()} if mesh is None else set()

    def divisor(self, module: nn.Module) -> int:
        """The experts' summed gradient over the data-parallel average: every rank's tokens
        add into it, each token once per tensor-parallel rank that routes it (all ``tp`` of
        them, unless they split each sequence between them: the module's ``token_shards``)."""
        copies = self.tp // getattr(module, "token_shards", 1)
        return self.world // self.tp * copies

    def average_unsharded(self) -> None:
        """A hook on each expert parameter FSDP leaves out: its gradient over ``divisor``, as
        FSDP averages the rest."""
        for module in self.modules:
            divisor = self.divisor(module)
            for param in module.parameters():
                if param in self.unsharded and param.requires_grad:  # a frozen one gets none
                    param.register_hook(lambda grad, divisor=divisor: grad / divisor)

    def shard_inside(
        self, layer: nn.Module, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy | None
    ) -> None:
        """``fully_shard`` each expert module of ``layer`` over the experts' mesh, before the
        layer itself (which then leaves their parameters to them)."""
        if self.mesh is None:
            return
        sharding = _sharding(self.mesh.size(), mp_policy)
        gloo = dist.get_backend(self.mesh.get_group()) == "gloo"
        inside = {id(m) for m in layer.modules()}
        for module in self.modules:
            if id(module) in inside:
                fully_shard(module, mesh=self.mesh, reshard_after_forward=reshard_after_forward, **sharding)
                module.set_gradient_divide_factor(self.divisor(module))
                # gloo has no pre-multiplied sum: divide before and after a plain sum instead
                module.set_force_sum_reduction_for_comms(gloo)


def _sharding(ranks: int, mp_policy: MixedPrecisionPolicy | None) -> dict[str, Any]:
    """``fully_shard``'s options over ``ranks``: the mixed-precision policy, and where to split
    each parameter. FSDP2 splits dim 0, padded to a multiple of the ranks, so a parameter whose
    dim 0 is smaller than that (grouped experts, ``[experts, ...]``, over more ranks than
    experts) would leave some ranks a shard of padding alone, as large as a real one: such a
    parameter is split on the dimension that pads least instead, as torchtitan splits its
    experts."""

    def least_padded(param: nn.Parameter) -> Shard | None:
        if param.ndim < 2 or param.shape[0] >= ranks:
            return None  # FSDP's own Shard(0)
        return Shard(min(range(param.ndim), key=lambda dim: -param.shape[dim] % ranks))

    return {"shard_placement_fn": least_padded} | ({} if mp_policy is None else {"mp_policy": mp_policy})


def _expert_parallel(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None, compiling: bool
) -> _Experts:
    """The modules that hold this rank's own experts, and how FSDP treats them (checked against
    the mesh). Left out of FSDP under a mixed-precision policy, each such module computes in
    its parameter dtype (the module's ``compute_dtype``), as FSDP's own parameters do; a module
    without one is refused."""
    expert_modules = [m for m in model.modules() if getattr(m, "expert_parallel_group", None) is not None]
    world = dist.get_world_size() if expert_modules else 1
    if not expert_modules:
        return _Experts([], None, world)
    groups = {id(m.expert_parallel_group): m.expert_parallel_group for m in expert_modules}
    if len(groups) != 1:
        raise ValueError("every expert-parallel module must use the same expert-parallel process group")
    group = next(iter(groups.values()))
    ep = dist.get_world_size(group)
    tp = mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
    if mesh.size() != world or world % ep:
        raise ValueError(
            f"parallelize supports expert parallelism over a divisor of the ranks of a mesh over every "
            f"rank: the mesh has {mesh.size()} ranks and the expert-parallel group {ep}, of {world} "
            "in all; build the model with an ep_group whose size divides the world size and a mesh "
            "covering all ranks"
        )
    if ep < world:
        layered = {id(m) for _, layer in find_layers(model) if layer is not model for m in layer.modules()}
        stray = [m for m in expert_modules if id(m) not in layered]
        if stray:
            raise ValueError(
                f"experts over {ep} of {world} ranks are sharded by FSDP inside their layer, and "
                f"{type(stray[0]).__name__} sits in no layer parallelize shards; declare "
                "the layer that holds it (recompute_intervals), or build the experts over every rank"
            )
        return _Experts(expert_modules, _expert_mesh(mesh, group, ep, compiling), world, tp)
    dtype = None if mp_policy is None else mp_policy.param_dtype
    uncast = [m for m in expert_modules if dtype is not None and not hasattr(m, "compute_dtype")]
    if uncast:
        raise ValueError(
            f"{type(uncast[0]).__name__} holds expert-parallel weights, which FSDP leaves out "
            f"and so does not cast to mp_policy's param_dtype ({dtype}); give the module a "
            "`compute_dtype` attribute its forward casts its weights to, or pass no mp_policy"
        )
    if dtype is not None:
        for module in expert_modules:
            module.compute_dtype = dtype
    return _Experts(expert_modules, None, world, tp)


def expert_parallel_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The 2-D ``("expert_dp", "ep")`` mesh over ``mesh``'s ranks (1-D, or ``("dp", "tp")``
    in rank order) that ``parallelize`` expects experts over ``ep`` of them laid out by:
    ``["ep"]`` consecutive blocks of ``ep`` ranks (build the model's expert-parallel group from
    it; with a tensor-parallel dimension a block may span tensor-parallel groups in any way),
    ``["expert_dp"]`` the ranks that hold the same experts. Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = mesh.size()
    return init_device_mesh(mesh.device_type, (world // ep, ep), mesh_dim_names=("expert_dp", "ep"))


def _expert_mesh(mesh: DeviceMesh, group: dist.ProcessGroup, ep: int, compiling: bool) -> DeviceMesh:
    """The 1-D mesh over the ranks that hold the same experts as this one, for an expert-parallel
    ``group`` of ``ep`` ranks laid out as consecutive blocks of ``mesh``'s."""
    if mesh.mesh_dim_names == ("tp",):
        raise ValueError(
            f"experts over {ep} of {mesh.size()} ranks are FSDP-sharded over the ranks that hold the "
            "same ones, and a mesh of tensor parallelism alone has no FSDP; use a ('dp', 'tp') mesh, "
            "or experts over every rank"
        )
    if compiling:
        raise ValueError(
            f"experts over {ep} of {mesh.size()} ranks are sharded by FSDP inside each layer, whose "
            "hooks would break the compiled layer's one graph; pass compile=False, or build the "
            "experts over every rank"
        )
    world = mesh.size()
    split = expert_parallel_mesh(mesh, ep)
    want = split["ep"].mesh.flatten().tolist()
    have = sorted(dist.get_process_group_ranks(group))
    if have != want:
        raise ValueError(
            f"the expert-parallel group holds ranks {have}, where parallelize expects {want}: "
            f"build it as init_device_mesh(device, ({world // ep}, {ep}), mesh_dim_names=('expert_dp', "
            "'ep'))['ep'].get_group() does, consecutive blocks of ranks"
        )
    return split["expert_dp"]


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


def _check_inputs(
    model: nn.Module, mesh: DeviceMesh, tp_plan: Any, sequence_parallel: bool | None
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The FSDP mesh and the tensor-parallel mesh (either may be None), after the checks."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}; build one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))"
        )
    names = mesh.mesh_dim_names
    if mesh.ndim == 2 and names == ("dp", "tp"):
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    elif mesh.ndim == 1 and names == ("tp",):
        dp_mesh, tp_mesh = None, mesh
    elif mesh.ndim == 1:
        dp_mesh, tp_mesh = mesh, None
    else:
        raise ValueError(
            f"parallelize supports a 1-D mesh (plain FSDP, or tensor parallelism when named ('tp',)) or a "
            f"2-D mesh named ('dp', 'tp'), got a {mesh.ndim}-D mesh with dimensions "
            f"{names or tuple(mesh.shape)}; HSDP is not supported yet: pass the data-parallel sub-mesh, "
            "e.g. mesh['dp'], or build init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    if tp_mesh is None and (tp_plan != "auto" or sequence_parallel is not None):
        raise ValueError(
            "tp_plan and sequence_parallel need a tensor-parallel mesh dimension: pass a mesh named "
            "('tp',) or ('dp', 'tp')"
        )
    sharded = [name or "<root>" for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if sharded:
        raise ValueError(
            f"the model is already sharded by fully_shard ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}); call parallelize on the unsharded model: "
            "it applies checkpointing before fully_shard so FSDP's hooks stay outside the replay"
        )
    compiled = [name for name, m in find_layers(model) if is_compiled_module(m)]
    if compiled:
        raise ValueError(
            f"layer {compiled[0]} is already compiled; pass compile=True to parallelize instead, so "
            "the checkpoint wrapper is installed before compilation"
        )
    if tp_mesh is not None and tp_plan is not None:
        reject_tensor_parallel(model)
    return dp_mesh, tp_mesh
