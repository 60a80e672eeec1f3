"""What the multi-rank test workers do after their scenario (imported by ``tp_worker``,
``titan_tp_worker`` and ``moe_ep_worker``, which torchrun runs as scripts from this folder)."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist


def write_gathered(findings: object, out_path: str, *, bare: bool = False) -> None:
    """Gather every rank's ``findings`` to rank 0, which writes them to ``out_path`` as JSON:
    ``{"world_size": N, "ranks": [...]}``, or (``bare``) the list alone; then leave the group."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, findings)
    if dist.get_rank() == 0:
        document = gathered if bare else {"world_size": dist.get_world_size(), "ranks": gathered}
        with open(out_path, "w") as out:
            json.dump(document, out, indent=None if bare else 1)
    dist.barrier()
    dist.destroy_process_group()


def leave() -> None:
    """End the process now, skipping interpreter teardown: gloo on torch 2.13 sometimes aborts
    in C++ while the interpreter shuts down, after all work is done ("terminate called without
    an active exception"; docs/concepts.md, Known limits). The results are written by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
