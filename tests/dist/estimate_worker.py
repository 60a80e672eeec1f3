"""The ranks of the estimate's exactness tests in ``tests/test_estimate_gloo.py``; launched by
torchrun on gloo/CPU, once per world size.

    torchrun --standalone --nproc-per-node N tests/dist/estimate_worker.py SCENARIOS.json OUT.json

SCENARIOS.json maps a scenario's name to ``{"shape": Shape.to_dict(), "fsdp": F, "tp": T,
"preset": P, "ep": E}`` (``F x T`` or ``E`` is the world size; P a preset name or a config
file's path). Each runs the estimate's own step (``actplan.planning._rank_step.step_on_mesh``)
on real tensors over the real gloo group, one after another in one process group (one launch,
not one per scenario); every rank's figures are gathered to rank 0, which writes
``{name: {"world_size": N, "ranks": [...]}}`` to OUT.json. With ``E`` > 1 the experts are split
over the ranks, and each rank's token counts (bincounts and the counts it received) are
recorded under ``routing``, for the fake rank to replay.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time

import torch
import torch.distributed as dist
from ranks import leave
from torch.utils._python_dispatch import TorchDispatchMode

from actplan.measure import RoutingRecorder
from actplan.models.shape import Shape
from actplan.planning._rank_step import layout_mesh, step_on_mesh


class SettleCollectives(TorchDispatchMode):
    """After each wait on a collective, a pause for gloo's worker thread to let go of the
    collective's input: the thread holds it until it retires the work, a moment after the wait
    returns, so without the pause a buffer the program already dropped can be alive at a peak
    or not, by thread timing (seen: 1 to 2 KiB more at the peak in about one run of four on a
    loaded machine). The fake process group's collectives retire at once."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            time.sleep(0.05)
        return out


def run(scenario: dict) -> dict:
    """This rank's figures for one scenario, its token counts under ``routing``."""
    shape = Shape(**scenario["shape"])
    ep = scenario.get("ep", 1)
    mesh = layout_mesh(scenario["fsdp"], scenario["tp"])
    recorder = RoutingRecorder()
    with SettleCollectives(), recorder:
        ran = step_on_mesh(shape, scenario["preset"], mesh, "h100", fake=False, ep=ep)
    return dataclasses.asdict(ran) | {"routing": recorder.counts}


def main(scenarios_path: str, out_path: str) -> None:
    with open(scenarios_path) as file:
        scenarios = json.load(file)
    dist.init_process_group("gloo")
    results = {}
    for name, scenario in scenarios.items():
        gc.collect()  # nothing of the scenario before is left to be freed inside this one
        dist.barrier()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, run(scenario))
        results[name] = {"world_size": dist.get_world_size(), "ranks": gathered}
    if dist.get_rank() == 0:
        with open(out_path, "w") as out:
            json.dump(results, out, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
