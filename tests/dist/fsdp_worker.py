"""One rank of the FSDP2 tests in ``tests/test_parallel.py``; launched by torchrun on gloo/CPU.

    torchrun --standalone --nproc-per-node 2 tests/dist/fsdp_worker.py SCENARIO OUT.json

Every rank runs the scenario; rank 0 writes its findings to ``OUT.json`` and the test
asserts on them. Scenarios:

* ``parity``: for each config and reshard setting, one FSDP step on the rank's half of a
  global batch, against a single-process, unsharded step on the whole batch. Records the
  loss, the gathered (``full_tensor``) gradients' largest differences, the grad census and
  the collectives that ran in forward and in backward, counted at the dispatcher; and a
  control in the wrong order (checkpointing around already sharded layers).
* ``memory``: 20 optimizer steps under a plan; tracked live bytes after each step.
* ``compile``: the parity step with each layer compiled (``aot_eager``) before sharding.
* ``fail``: rank 1 raises while rank 0 waits in a barrier (tests the launcher's error path).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import actplan
from actplan.measure import MemoryMeter, OpCounter, capture_step, compare_steps
from actplan.models import build_model
from actplan._install.parallel import parallelize

# The ops that move data between ranks: c10d's in-place ops (what FSDP2 calls through
# torch.distributed), functional collectives, and FSDP2's own copy-in/out custom ops.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "fsdp")
GLOBAL_BATCH = 4
# Offload under FSDP2: kept units and the input of selective layers; units of plain layers.
OFFLOAD_CONFIGS = {
    "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept", "layer_input": True, "min_bytes": 0}},
    "none+offload": {"preset": "none", "offload": {"units": ["attn_core", "mlp_up"], "min_bytes": 0}},
}
CONFIGS = ("none", "full", "matmuls", *OFFLOAD_CONFIGS)


def collective_counts(counter: OpCounter) -> dict[str, int]:
    counts = sorted(counter.counts.items(), key=str)
    return {str(op): n for op, n in counts if op.namespace in COLLECTIVE_NAMESPACES}


def local_batch(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per_rank = GLOBAL_BATCH // world
    return {key: value[rank * per_rank : (rank + 1) * per_rank] for key, value in batch.items()}


def reference_step(bundle) -> actplan.measure.StepCapture:
    model = copy.deepcopy(bundle.model)
    loss = model(**bundle.make_batch(0))["loss"]
    loss.backward()
    return capture_step(model, loss)


def sharded_step(bundle, mesh, config, *, reshard: bool, compile_options=None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(bundle.model)
    plan = parallelize(
        model,
        mesh,
        OFFLOAD_CONFIGS.get(config, config),
        reshard_after_forward=reshard,
        compile=compile_options or False,
    )
    batch = local_batch(bundle.make_batch(0), rank, world)
    # Module calls of each layer: a replay that went through the module would re-fire FSDP's hooks.
    layer_calls: Counter = Counter()
    for _, layer in actplan.lowlevel.find_layers(model):
        layer.register_forward_pre_hook(lambda *_: layer_calls.update(["calls"]))
    # Dynamo does not run compiled frames under a dispatch mode: count compiled forwards not at all.
    # Backward is eager autograd either way (FSDP's hooks, the replay), so it is always counted.
    forward_ops, backward_ops = OpCounter(), OpCounter()
    with forward_ops if compile_options is None else contextlib.nullcontext():
        loss = model(**batch)["loss"]
    calls_in_forward = layer_calls["calls"]
    with backward_ops:
        loss.backward()
    # Mean of per-rank means over equal token counts is the global mean.
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss /= world
    # A full-size, plain-tensor copy of the step for compare_steps.
    unsharded = copy.deepcopy(bundle.model)
    targets = dict(unsharded.named_parameters())
    for name, param in model.named_parameters():
        targets[name].grad = None if param.grad is None else param.grad.full_tensor()
    engine = actplan.lowlevel.installed_plan(model).offload_engine
    return {
        "offloaded_bytes": engine.stats.bytes_offloaded if engine is not None else None,
        "capture": capture_step(unsharded, global_loss),
        "modes": [layer.mode for layer in plan.layers],
        "forward_collectives": collective_counts(forward_ops),
        "backward_collectives": collective_counts(backward_ops),
        "grads_are_dtensors": all(type(p.grad).__name__ == "DTensor" for p in model.parameters()),
        "layer_calls_in_forward": calls_in_forward,
        "layer_calls_in_backward": layer_calls["calls"] - calls_in_forward,
    }


def outer_checkpoint_step(bundle, mesh) -> dict:
    """The wrong order, as a control: shard first, then checkpoint each sharded module from outside.

    The replay then calls the module, so its hooks (FSDP's and ours) fire again in backward.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(bundle.model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layer_calls: Counter = Counter()
    for index, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda *_: layer_calls.update(["calls"]))
        model.layers[index] = checkpoint_wrapper(layer)
    loss = model(**local_batch(bundle.make_batch(0), rank, world))["loss"]
    calls_in_forward = layer_calls["calls"]
    with OpCounter() as backward_ops:
        loss.backward()
    return {
        "layer_calls_in_forward": calls_in_forward,
        "layer_calls_in_backward": layer_calls["calls"] - calls_in_forward,
        "backward_collectives": collective_counts(backward_ops),
    }


def compare(baseline, candidate) -> dict:
    report = compare_steps(baseline, candidate)
    return {
        "loss_abs_diff": report.loss_abs_diff,
        "loss_identical": report.loss_identical,
        "max_abs_grad_diff": report.max_abs_grad_diff,
        "worst_param": report.worst_param,
        "census_match": report.census_match,
        "census_diff": report.census_diff,
        "max_abs_grad": max(g.abs().max().item() for g in baseline.grads.values() if g is not None),
    }


def scenario_parity(mesh, compile_options=None, configs=CONFIGS, reshards=(True, False)) -> dict:
    bundle = build_model("dense", "tiny", batch_size=GLOBAL_BATCH)
    reference = reference_step(bundle)
    results = {}
    for reshard in reshards:
        sharded_none = None
        for config in configs:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            step = sharded_step(bundle, mesh, config, reshard=reshard, compile_options=compile_options)
            if config == "none":
                sharded_none = step["capture"]
            results[f"{config}/reshard={reshard}"] = {
                **{key: value for key, value in step.items() if key != "capture"},
                "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                "vs_single_process": compare(reference, step["capture"]),
                "vs_sharded_none": compare(sharded_none, step["capture"]) if sharded_none else None,
                "reference_census_nonzero": len(reference.census.nonzero),
            }
    if compile_options is None:
        results["control/outer-checkpoint"] = outer_checkpoint_step(bundle, mesh)
    return results


def scenario_memory(mesh, configs=("full", "matmuls"), steps=20) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    bundle = build_model("dense", "tiny", batch_size=GLOBAL_BATCH)
    results = {}
    for config in configs:
        model = copy.deepcopy(bundle.model)
        parallelize(model, mesh, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        live_after_step = []
        with MemoryMeter(model, optimizer) as meter:
            for step in range(steps):
                batch = local_batch(bundle.make_batch(step), rank, world)
                loss = model(**batch)["loss"]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
                live_after_step.append(meter.mark(f"step{step}").live_bytes)
        results[config] = {
            "live_after_step": live_after_step,
            "peak_live_bytes": meter.report().peak_live_bytes,
        }
    return results


def main() -> None:
    scenario, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if scenario == "parity":
            results = scenario_parity(mesh)
        elif scenario == "memory":
            results = scenario_memory(mesh)
        elif scenario == "fail":
            # For the harness test: one rank dies while the other waits for it in a collective.
            if dist.get_rank() == 1:
                raise RuntimeError("rank 1 fails on purpose")
            dist.barrier()
            results = {}
        elif scenario == "compile":
            results = scenario_parity(
                mesh, compile_options={"backend": "aot_eager"}, configs=("none", "matmuls"), reshards=(True,)
            )
        else:
            raise SystemExit(f"unknown scenario {scenario!r}; choose parity, memory, compile or fail")
        dist.barrier()
        if dist.get_rank() == 0:
            with open(out_path, "w") as out:
                json.dump({"world_size": dist.get_world_size(), "results": results}, out, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # gloo on torch 2.13 sometimes aborts in C++ while the interpreter shuts down, after all
    # work is done (docs/concepts.md, Known limits): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
