"""One rank of the estimate's exactness test in ``tests/test_estimate_gloo.py``; launched by
torchrun on gloo/CPU.

    torchrun --standalone --nproc-per-node N tests/dist/estimate_worker.py SHAPE FSDP TP PRESET [EP] OUT

Runs the estimate's own step (``actplan.planning._rank_step.step_on_mesh``) on real tensors
over a real gloo group of ``FSDP x TP`` ranks, at the shape in SHAPE.json (``Shape.to_dict``),
and gathers every rank's figures to rank 0, which writes them to ``OUT.json``. With ``EP`` > 1
the experts are split over the ranks, and each rank's token counts (bincounts and the counts
it received) are recorded under ``routing``, for the fake rank to replay.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist
from ranks import leave, write_gathered
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


def main() -> None:
    shape_path, fsdp, tp, preset, *rest = sys.argv[1:]
    fsdp, tp, out, ep = int(fsdp), int(tp), rest[-1], int(rest[0]) if len(rest) > 1 else 1
    with open(shape_path) as file:
        shape = Shape(**json.load(file))
    dist.init_process_group("gloo")
    recorder = RoutingRecorder()
    with SettleCollectives(), recorder:
        ran = step_on_mesh(shape, preset, layout_mesh(fsdp, tp), "h100", fake=False, expert_parallel=ep > 1)
    write_gathered(dataclasses.asdict(ran) | {"routing": recorder.counts}, out)
    leave()


if __name__ == "__main__":
    main()
