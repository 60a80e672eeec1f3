"""Two-rank expert-parallel MoE worker, launched by tests/test_moe_ep.py under torchrun.

Usage: moe_ep_worker.py PLAN OUT_JSON (PLAN: a preset name or a JSON config).
Every rank builds the single-process model on the global batch as the reference,
then the expert-parallel model (experts split over ranks, tokens exchanged with
all_to_all) on its half of the batch under PLAN, and compares: loss, every
gradient (replicated ones averaged over ranks, expert ones on their owner),
routing decisions, and how many collectives ran in forward and in backward.
Then 20 training steps measure whether live memory stays flat. Rank 0 writes
the findings as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import actplan
from actplan.measure import MemoryMeter, OpCounter
from actplan.models import moe

COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def collectives(counter: OpCounter) -> int:
    return sum(n for op, n in counter.counts.items() if getattr(op, "namespace", "") in COLLECTIVE_NAMESPACES)


def main(plan: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config_overrides = {"aux_loss_coef": 0.0}  # the balance loss is per rank by design
    reference, config = moe.build("tiny", **config_overrides)
    per_rank = config.batch_size
    batch = moe.make_batch(config, seed=1, batch_size=per_rank * world)
    mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}

    out_ref = reference(**batch)
    out_ref["loss"].backward()

    model, _ = moe.build("tiny", ep_group=dist.group.WORLD, **config_overrides)
    if plan != "none":
        actplan.apply(model, json.loads(plan) if plan.startswith("{") else plan)
    with OpCounter() as forward_ops:
        out = model(**mine)
    with OpCounter() as backward_ops:
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
        grad = param.grad.clone()
        if name.endswith(("w_gate", "w_up", "w_down")):
            # Each rank's backward adds its tokens' share into the owner's experts.
            want = ref_param.grad[ep.first : ep.first + ep.n_local] * world
        else:
            dist.all_reduce(grad)
            grad /= world
            want = ref_param.grad
        diff = (grad - want).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
    # Routing: this rank's tokens are rows [rank * per_rank, ...) of the reference's.
    tokens = per_rank * config.seq_len
    routing_equal = all(
        torch.equal(ids, ref_ids[rank * tokens : (rank + 1) * tokens])
        for ids, ref_ids in zip(out["expert_ids"], out_ref["expert_ids"], strict=True)
    )

    # Memory over 20 steps, one meter window: live bytes at each step's end.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    optimizer.zero_grad(set_to_none=True)
    live_after_step = []
    with MemoryMeter(model, optimizer) as meter:
        for _ in range(20):
            model(**mine)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            live_after_step.append(meter.live_bytes)

    results = {
        "rank": rank,
        "loss": loss.item(),
        "reference_loss": out_ref["loss"].item(),
        "max_grad_diff": worst,
        "worst_param": worst_name,
        "missing_grads": missing,
        "routing_equal": routing_equal,
        "forward_collectives": collectives(forward_ops),
        "backward_collectives": collectives(backward_ops),
        "backward_topk": backward_ops[torch.ops.aten.topk.default],
        "live_after_step": live_after_step,
        "peak_live_bytes": meter.report().peak_live_bytes,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
