"""One rank of the tensor-parallel tests in ``tests/test_tp.py``; launched by torchrun on gloo/CPU.

    torchrun --standalone --nproc-per-node 2 tests/dist/tp_worker.py parity MODELS MESH [PLANS.json] OUT.json
    torchrun --standalone --nproc-per-node 2 tests/dist/tp_worker.py titan OUT.json

``parity``: MODELS, comma-separated, run one after another in the one process group, each of
``dense`` (sequence parallel), ``dense-nosp``, ``moe``, ``moe-ep`` (experts split over every
rank) or ``hf-llama`` (sequence parallel); MESH is ``tp2`` (one
tensor-parallel group of 2, no FSDP) or ``dp2tp2`` (4 ranks: tensor parallelism inside pairs,
FSDP2 over the pairs). PLANS.json, if given, maps ``dense``, ``moe`` and ``hf-llama`` to one more
config, ``planner`` (what ``tests/test_tp.py`` had actplan's planner pick for the whole model;
``dense-nosp`` and ``moe-ep`` use their model's). For each config, a fresh copy of the model goes through
``actplan.parallelize`` and runs one step on this rank's data (the tensor-parallel ranks of a
pair share theirs). Each rank compares its *local* gradient shards, their placements and the
loss with the ``none`` run's, bit for bit, and the full (``full_tensor``) gradients with a
single-process step on the whole batch; it counts the collectives that ran in forward and in
backward at the dispatcher, and measures activation bytes with ``MemoryMeter``. ``none`` runs
twice: the second run against the first is the noise floor.

``titan``: torchtitan issue #2763's setting, on the dense model under eager TP + SP: the last
block checkpointed whole, by ``torch.utils.checkpoint`` (torchtitan's full AC) and by actplan's
``full``. Counts the last block's ``down_proj`` calls in backward (a replay re-running it) and
the collectives there, and tracks live bytes over 20 optimizer steps.

Every rank gathers its findings to rank 0, which writes them to ``OUT.json``.
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import json
import math
import os
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import actplan
from actplan._install.parallel import tensor_parallelize
from actplan.measure import MemoryMeter, OpCounter
from actplan.models import build_model, load_model
from actplan.models import moe as moe_model
from ranks import leave, write_gathered

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "fsdp")
# Moving data between ranks; _wrap_tensor_autograd and wait_tensor only wrap or wait for them.
NOT_COMMUNICATION = ("_wrap_tensor_autograd", "wait_tensor")
CONFIGS = {
    "none": "none",
    "full": "full",
    "full+save_collectives": {"preset": "full", "save_collectives": True},
    "attn": "attn",
    "matmuls": "matmuls",
    "megatron-selective": "megatron-selective",
}
ROWS_PER_DP_RANK = 2
PLANNED_AS = {"dense-nosp": "dense", "moe-ep": "moe"}  # the planner's plan each model runs


def worse(diff: float, worst: float) -> bool:
    """``diff`` replaces ``worst``: larger, or the first NaN (which stays)."""
    return not math.isnan(worst) and (math.isnan(diff) or diff > worst)


def collectives(counter: OpCounter) -> dict[str, int]:
    return {
        str(op): n
        for op, n in sorted(counter.counts.items(), key=str)
        if getattr(op, "namespace", "") in COLLECTIVE_NAMESPACES
        and str(op).split(".")[1] not in NOT_COMMUNICATION
    }


def build(name: str, dp: int):
    """(model, single-process reference model, make_batch(seed, rows)), seeded: identical on
    every rank (an expert-parallel model holds this rank's experts, its reference all of them)."""
    if name.startswith("dense"):
        bundle = build_model("dense", "tiny")
        config = bundle.model.config
        return bundle.model, bundle.model, lambda seed, rows: moe_model.make_batch(config, seed, rows)
    if name.startswith("moe"):
        # The balance loss is per rank by design: off where ranks see different tokens.
        overrides = {"aux_loss_coef": 0.0 if dp > 1 else 0.01}
        reference, config = moe_model.build("tiny", **overrides)
        model = reference
        if name == "moe-ep":
            model = moe_model.build("tiny", ep_group=dist.group.WORLD, **overrides)[0]
        return model, reference, lambda seed, rows: moe_model.make_batch(config, seed, rows)
    bundle = load_model(name, "tiny")

    def hf_batch(seed: int, rows: int):
        made = [bundle.make_batch(seed * 100 + row) for row in range(rows)]
        return {key: torch.cat([m[key][:1] for m in made]) for key in made[0]}

    return bundle.model, bundle.model, hf_batch


def loss_of(output) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output.loss


def reference_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    loss = loss_of(model(**batch))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def one_step(base, mesh, config, batch, sequence_parallel):
    model = copy.deepcopy(base)
    kwargs = {} if sequence_parallel is None else {"sequence_parallel": sequence_parallel}
    plan = actplan.parallelize(model, mesh, config, **kwargs)
    forward_ops, backward_ops = OpCounter(), OpCounter()
    started = time.perf_counter()
    with MemoryMeter(model) as meter:
        with forward_ops:
            loss = loss_of(model(**batch))
        at_forward_end = meter.mark("forward_end")
        with backward_ops:
            loss.backward()
    seconds = time.perf_counter() - started
    report = meter.report()
    return model, {
        "modes": sorted({layer.mode for layer in plan.layers}),
        "loss": loss.detach().clone(),
        "grads": {name: (None if p.grad is None else p.grad) for name, p in model.named_parameters()},
        "forward_collectives": collectives(forward_ops),
        "backward_collectives": collectives(backward_ops),
        "activation_bytes_at_forward_end": at_forward_end.activation_bytes,
        "peak_live_bytes": report.peak_live_bytes,
        "step_seconds": seconds,
    }


def local(grad):
    if grad is None:
        return None, None
    if isinstance(grad, DTensor):
        return grad.to_local(), [str(p) for p in grad.placements]
    return grad, None


def bit_compare(base: dict, run: dict) -> dict:
    """Loss and every local gradient shard of ``run`` against ``base`` on this rank."""
    worst, worst_name, differ, placements_differ, nonfinite = 0.0, None, [], [], []
    for name, grad in run["grads"].items():
        mine, mine_placements = local(grad)
        theirs, their_placements = local(base["grads"][name])
        if (mine is None) != (theirs is None):
            differ.append(name)
            continue
        if mine is None:
            continue
        if mine_placements != their_placements:
            placements_differ.append(name)
        if not bool(mine.isfinite().all()):
            nonfinite.append(name)
        if not torch.equal(mine, theirs):
            differ.append(name)
            diff = (mine - theirs).abs().max().item()
            if worse(diff, worst):
                worst, worst_name = diff, name
    return {
        "loss_identical": bool(torch.equal(run["loss"], base["loss"])),
        "grads_identical": not differ and not placements_differ,
        "differing_grads": differ[:6],
        "placements_differ": placements_differ[:6],
        "nonfinite_grads": nonfinite[:6],
        "max_abs_grad_diff": worst,
        "worst_param": worst_name,
    }


def vs_single_process(model, run, reference_loss, reference, world) -> dict:
    """Full gradients against one process on the whole batch (tensor-parallel rounding only)."""
    worst, worst_name, missing = 0.0, None, []
    experts = {
        id(p) for m in model.modules() if getattr(m, "expert_parallel_group", None) for p in m.parameters()
    }
    group = getattr(model, "expert_group", None)
    for name, param in model.named_parameters():
        grad = run["grads"][name]
        if grad is None:
            missing.append(name)
            continue
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        want = reference[name]
        if id(param) in experts:
            want = want[group.first : group.first + group.n_local]
        diff = (full - want).abs().max().item()
        if worse(diff, worst):
            worst, worst_name = diff, name
    loss = run["loss"].clone()
    dist.all_reduce(loss)  # the tensor-parallel ranks of a pair have the same loss
    return {
        "loss_abs_diff": abs(loss.item() / world - reference_loss),
        "max_abs_grad_diff": worst,
        "worst_param": worst_name,
        "missing_grads": missing,
        "max_abs_grad": max(g.abs().max().item() for g in reference.values()),
    }


MEMORY_FIELDS = ("activation_bytes_at_forward_end", "peak_live_bytes")
RETRIES = 2


def settle_memory(entry: dict, floor: dict, again) -> None:
    """Gloo runs each collective on its own thread, which may let go of the collective's buffers
    a moment after the step has (seen at forward end: an all-gather output and the matmul output
    it read, 24 KiB on the moe model, on about one step in ten). A step that measures above
    no checkpointing's lowest figure (``floor``) is run again, up to ``RETRIES`` times, and each memory figure keeps its
    lowest: a late free never lowers a figure, so the minimum is the step's own. Every rank
    reruns when any rank is above (the step's collectives need them all). The retries are
    recorded."""
    for retry in range(RETRIES):
        above = torch.tensor(float(any(entry[key] > floor[key] for key in MEMORY_FIELDS)))
        dist.all_reduce(above, op=dist.ReduceOp.MAX)
        if not above.item():
            return
        run = again()
        for key in MEMORY_FIELDS:
            entry[key] = min(entry[key], run[key])
        entry["memory_retries"] = retry + 1


def scenario_parity(model_name: str, mesh_name: str, plans_path: str | None = None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if mesh_name == "tp2":
        mesh, dp, dp_rank = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), 1, 0
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp, dp_rank = world // 2, mesh.get_local_rank("dp")
    base, reference_model, make_batch = build(model_name, dp)
    whole = make_batch(7, ROWS_PER_DP_RANK * dp)
    batch = {k: v[dp_rank * ROWS_PER_DP_RANK : (dp_rank + 1) * ROWS_PER_DP_RANK] for k, v in whole.items()}
    reference_loss, reference = reference_grads(reference_model, whole)
    sequence_parallel = False if model_name == "dense-nosp" else None
    configs = dict(CONFIGS)
    if plans_path is not None:
        with open(plans_path) as plans:
            configs["planner"] = json.load(plans)[PLANNED_AS.get(model_name, model_name)]
    results, none_run = {}, None
    for name, config in [("none", "none"), ("none-again", "none"), *list(configs.items())[1:]]:
        started = time.perf_counter()
        model, run = one_step(base, mesh, config, batch, sequence_parallel)
        entry = {key: value for key, value in run.items() if key not in ("loss", "grads")}
        entry["vs_single_process"] = vs_single_process(model, run, reference_loss, reference, world)
        if none_run is None:
            none_run = run
        else:
            entry["vs_none"] = bit_compare(none_run, run)
        entry["seconds"] = time.perf_counter() - started
        entry["dtensor_params"] = sum(isinstance(p, DTensor) for p in model.parameters())
        del model, run
        if name != "none":
            floor = {key: min(results[n][key] for n in ("none", "none-again") if n in results) for key in MEMORY_FIELDS}
            settle_memory(entry, floor, lambda: one_step(base, mesh, config, batch, sequence_parallel)[1])
        results[name] = entry
    return {"rank": rank, "results": results}


def scenario_titan() -> dict:
    """torchtitan #2763: eager TP + SP, the last block checkpointed, 20 steps."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    bundle = build_model("dense", "tiny", n_layers=3)
    batch = bundle.make_batch(3)
    results = {}
    for how in ("none", "torch-checkpoint", "actplan-full", "actplan-matmuls"):
        model = copy.deepcopy(bundle.model)
        last = len(model.layers) - 1
        if how == "torch-checkpoint":
            # torchtitan's full AC: TP first, then the block wrapped by torch.utils.checkpoint.
            tensor_parallelize(model, mesh)
            model.layers[last] = checkpoint_wrapper(model.layers[last])
        else:
            preset = how.removeprefix("actplan-")
            config = {"preset": preset, "layers": {"last": 1}} if preset != "none" else "none"
            actplan.parallelize(model, mesh, config)
        down = model.get_submodule(f"layers.{last}").get_submodule(
            "_checkpoint_wrapped_module.mlp.down_proj" if how == "torch-checkpoint" else "mlp.down_proj"
        )
        calls = Counter()
        # Entered (pre-hook) and finished (hook): a replay may enter it and stop at its saved input.
        down.register_forward_pre_hook(lambda *_, calls=calls: calls.update(["entered"]))
        down.register_forward_hook(lambda *_, calls=calls: calls.update(["finished"]))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # Everything alive now is left out of the collections below (each full collection
        # otherwise walks all of torch's objects: 0.15 s, a third of this scenario's time).
        gc.collect()
        gc.freeze()
        live_after_step, backward_collectives, backward_mm = [], [], []
        forward_calls, backward_entered, backward_finished = [], [], []
        with MemoryMeter(model, optimizer) as meter:
            for _step in range(20):
                before = Counter(calls)
                loss = model(**batch)["loss"]
                forward_calls.append(calls["finished"] - before["finished"])
                before = Counter(calls)
                with OpCounter() as backward_ops:
                    loss.backward()
                backward_entered.append(calls["entered"] - before["entered"])
                backward_finished.append(calls["finished"] - before["finished"])
                backward_collectives.append(sum(collectives(backward_ops).values()))
                backward_mm.append(backward_ops[torch.ops.aten.mm.default])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
                # The output of a functional all-reduce inside DTensor's loss-parallel
                # cross-entropy (256 bytes) can outlive the step for a moment: held by gloo's
                # worker thread until its work is retired, or by a reference cycle until the
                # collector runs. Retire the group's work and collect (torchtitan's trainer
                # collects each step), so "flat" means no leak rather than thread or gc timing.
                # The barrier may finish on another of gloo's threads than the work: on the
                # first step, and on any step off the first one's figure, measure again while
                # the figure still falls (a leak never does).
                dist.barrier(group=mesh.get_group())
                gc.collect()
                live = meter.mark("step").live_bytes
                for _ in range(5 if not live_after_step or live != live_after_step[0] else 0):
                    time.sleep(0.02)
                    gc.collect()
                    settled = meter.mark("step").live_bytes
                    if settled >= live:
                        break
                    live = settled
                live_after_step.append(live)
        gc.unfreeze()
        results[how] = {
            "forward_down_proj_calls": forward_calls,
            "backward_down_proj_entered": backward_entered,
            "backward_down_proj_finished": backward_finished,
            "backward_mm": backward_mm,
            "backward_collectives": backward_collectives,
            "live_after_step": live_after_step,
            "peak_live_bytes": meter.report().peak_live_bytes,
        }
    return {"rank": dist.get_rank(), "results": results}


def main() -> None:
    faulthandler.enable()
    scenario, out_path = sys.argv[1], sys.argv[-1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    started = time.perf_counter()
    if scenario == "parity":
        plans = sys.argv[4] if len(sys.argv) == 6 else None
        findings = {"rank": dist.get_rank(), "results": {}}
        for model_name in sys.argv[2].split(","):
            torch.manual_seed(0)
            findings["results"][model_name] = scenario_parity(model_name, sys.argv[3], plans)["results"]
    elif scenario == "titan":
        findings = scenario_titan()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}; choose parity or titan")
    findings["seconds"] = time.perf_counter() - started
    write_gathered(findings, out_path)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave()
