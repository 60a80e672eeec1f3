"""Expert-parallel MoE worker (2 or 4 ranks), launched by tests/test_moe_ep.py under torchrun.

Usage: moe_ep_worker.py SCENARIOS [OVERRIDES] OUT_JSON, where OVERRIDES (a JSON object) changes
the tiny MoE's config for every model of the launch, and SCENARIOS is a JSON object naming each
scenario ``[PLAN, HOW]``, or ``[PLAN, HOW, OPTIONS]`` with ``{"config": its own config
changes, "steps": the training steps of the memory check (20; 0 skips it)}`` (PLAN: a
preset name or a JSON config; HOW: ``""``, ``fsdp``, ``fsdp-compile``, ``fsdp-ep2``, ``tp-ep2``,
``tp-epall`` or ``tp-ep2-nosp``). All scenarios run in one process group, one after another (the launch, not
the scenario, is what costs). With ``fsdp`` the model goes through ``actplan.parallelize`` on a
mesh over every rank, with ``fsdp-compile`` also compiling each layer, aot_eager (its collectives
are not counted then, since a dispatch mode would make dynamo run the compiled layers eagerly);
with ``fsdp-ep2`` the experts are split over 2 of the ranks (launched on 4: FSDP shards each
expert over the 2 ranks that hold it, inside each layer). ``tp-ep2`` and ``tp-epall`` run FSDP
over pairs of tensor-parallel ranks with sequence parallelism (a ``("dp", "tp")`` mesh; each
pair takes a data-parallel share of the batch, each rank of a pair half its sequence), the
experts over each pair (FSDP-sharded over the pairs) or over every rank; ``tp-ep2-nosp`` as
``tp-ep2`` without sequence parallelism (both ranks of a pair route the same tokens).
Every rank builds the single-process model on the global batch as the reference,
then for each scenario the expert-parallel model (experts split over ranks, tokens exchanged
with all_to_all) on its half of the batch under PLAN, and compares: loss, every
gradient (replicated ones averaged over ranks, expert ones on their owner),
routing decisions, and how many collectives ran in forward and in backward.
Then 20 training steps measure whether live memory stays flat. Rank 0 writes
the findings as JSON: one ``{scenario: findings}`` per rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import actplan
from actplan.measure import MemoryMeter, OpCounter
from actplan.models import moe
from ranks import leave, write_gathered

COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def collectives(counter: OpCounter) -> int:
    return sum(n for op, n in counter.counts.items() if getattr(op, "namespace", "") in COLLECTIVE_NAMESPACES)


CONFIG_OVERRIDES = {"aux_loss_coef": 0.0}  # the balance loss is per rank by design


def main(scenarios: str, *rest: str) -> None:
    faulthandler.enable()  # a rank that aborts in C++ still shows its Python stack
    *overrides, out_path = rest
    CONFIG_OVERRIDES.update(json.loads(overrides[0]) if overrides else {})
    dist.init_process_group("gloo")
    findings = {}
    for name, (plan, how, *own) in json.loads(scenarios).items():
        options = own[0] if own else {}
        findings[name] = scenario(plan, how, *references(options.get("config", {})), options.get("steps", 20))
    write_gathered(findings, out_path, bare=True)
    leave()


_REFERENCES: dict[str, tuple] = {}


def references(overrides: dict) -> tuple:
    """The single-process reference for the launch's config with a scenario's own
    ``overrides`` (its options' ``config``): the model after its backward on the global
    batch, its outputs, the batch, the rows per rank, the sequence length and the overrides."""
    key = json.dumps(overrides, sort_keys=True)
    if key not in _REFERENCES:
        torch.manual_seed(0)
        reference, config = moe.build("tiny", **(CONFIG_OVERRIDES | overrides))
        per_rank = config.batch_size
        batch = moe.make_batch(config, seed=1, batch_size=per_rank * dist.get_world_size())
        out_ref = reference(**batch)
        out_ref["loss"].backward()
        _REFERENCES[key] = (reference, out_ref, batch, per_rank, config.seq_len, overrides)
    return _REFERENCES[key]


def scenario(
    plan: str,
    how: str,
    reference,
    out_ref: dict,
    batch: dict,
    per_rank: int,
    seq_len: int,
    overrides: dict,
    steps: int = 20,
) -> dict:
    """One scenario on this rank (see the module doc): its findings."""
    tp = 2 if how.startswith("tp-") else 1
    fsdp, compiling = how.startswith(("fsdp", "tp-")), how == "fsdp-compile"
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank // tp * per_rank * tp, (rank // tp + 1) * per_rank * tp)  # a pair shares its rows
    mine = {k: v[rows] for k, v in batch.items()}
    if compiling:  # this scenario's graphs only
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    group = dist.group.WORLD
    if how in ("fsdp-ep2", "tp-ep2", "tp-ep2-nosp"):
        group = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("expert_dp", "ep"))["ep"].get_group()
    model, _ = moe.build("tiny", ep_group=group, **(CONFIG_OVERRIDES | overrides))
    config_arg = json.loads(plan) if plan.startswith("{") else plan
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        actplan.parallelize(model, mesh, config_arg, sequence_parallel=not how.endswith("-nosp"))
    elif fsdp:
        compile_options = {"backend": "aot_eager"} if compiling else False
        actplan.parallelize(model, init_device_mesh("cpu", (world,)), config_arg, compile=compile_options)
    elif plan != "none":
        actplan.apply(model, config_arg)
    with contextlib.nullcontext(OpCounter()) if compiling else OpCounter() as forward_ops:
        out = model(**mine)
    with contextlib.nullcontext(OpCounter()) if compiling else OpCounter() as backward_ops:
        out["loss"].backward()

    loss = out["loss"].detach().clone()
    dist.all_reduce(loss)
    loss /= world
    ep = model.expert_group
    worst, worst_name, missing = 0.0, None, []
    for (name, param), (_, ref_param) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        if param.grad is None:
            missing.append(name)
            continue
        expert = name.endswith(("w_gate", "w_up", "w_down"))
        # FSDP averaged the replicated gradients over ranks; without it, do that here.
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad.clone()
        if not expert and not fsdp:
            dist.all_reduce(grad)
            grad /= world
        # Each rank's backward adds its tokens' share into the owner's experts; under
        # parallelize a hook divides that sum by the world size, like FSDP's average.
        expert_scale = 1 if fsdp else world
        want = ref_param.grad[ep.first : ep.first + ep.n_local] * expert_scale if expert else ref_param.grad
        diff = (grad - want).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
    # Routing: this rank's tokens are its rows of the reference's batch, and under sequence
    # parallelism its share of their sequence.
    split = tp if not how.endswith("-nosp") else 1
    shard = slice(rank % split * seq_len // split, (rank % split + 1) * seq_len // split)
    routing_equal = all(
        torch.equal(ids, ref_ids.view(-1, seq_len, ids.shape[-1])[rows, shard].reshape(ids.shape))
        for ids, ref_ids in zip(out["expert_ids"], out_ref["expert_ids"], strict=True)
    )

    # Memory over `steps` steps (20), one meter window: live bytes at each step's end.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    optimizer.zero_grad(set_to_none=True)
    live_after_step = []
    with MemoryMeter(model, optimizer, run_compiled=compiling) as meter:
        for _ in range(steps):
            model(**mine)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            live_after_step.append(meter.live_bytes)

    return {
        "rank": rank,
        "loss": loss.item(),
        "reference_loss": out_ref["loss"].item(),
        "max_grad_diff": worst,
        "worst_param": worst_name,
        "missing_grads": missing,
        "routing_equal": routing_equal,
        "forward_collectives": collectives(forward_ops),
        "backward_collectives": collectives(backward_ops),
        "backward_collective_ops": {
            str(op): n
            for op, n in backward_ops.counts.items()
            if getattr(op, "namespace", "") in COLLECTIVE_NAMESPACES
        },
        "backward_topk": backward_ops[torch.ops.aten.topk.default],
        "live_after_step": live_after_step,
        "peak_live_bytes": meter.report().peak_live_bytes,
        "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] if compiling else 0,
        # the dimensions FSDP split the expert weights on
        "expert_split_dims": sorted(
            {
                p.placements[0].dim
                for n, p in model.named_parameters()
                if n.endswith("w_up") and isinstance(p, DTensor)
            }
        ),
    }


if __name__ == "__main__":
    main(*sys.argv[1:])
