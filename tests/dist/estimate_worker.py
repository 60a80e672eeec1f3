"""One rank of the estimate's exactness test in ``tests/test_estimate_gloo.py``; launched by
torchrun on gloo/CPU.

    torchrun --standalone --nproc-per-node N tests/dist/estimate_worker.py SHAPE.json FSDP TP PRESET OUT.json

Runs the estimate's own step (``actplan.planning._rank_step.step_on_mesh``) on real tensors
over a real gloo group of ``FSDP x TP`` ranks, at the shape in SHAPE.json (``Shape.to_dict``),
and gathers every rank's figures to rank 0, which writes them to ``OUT.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch.distributed as dist
from ranks import leave, write_gathered

from actplan.models.shape import Shape
from actplan.planning._rank_step import layout_mesh, step_on_mesh


def main() -> None:
    shape_path, fsdp, tp, preset, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
    with open(shape_path) as file:
        shape = Shape(**json.load(file))
    dist.init_process_group("gloo")
    ran = step_on_mesh(shape, preset, layout_mesh(fsdp, tp), "h100", fake=False)
    write_gathered(dataclasses.asdict(ran), out)
    leave()


if __name__ == "__main__":
    main()
