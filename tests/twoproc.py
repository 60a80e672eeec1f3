"""Launch a worker script on two CPU ranks (gloo) under torchrun and read its JSON result.

Shared by the multi-process tests. A failing or hanging rank fails the calling test
with the ranks' own output, not a bare exit code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _rank_errors(stderr: str) -> str:
    """The ranks' own output lines (tracebacks), without torch's log lines."""
    lines = [
        line
        for line in stderr.splitlines()
        if line.startswith("[rank") and not re.match(r"\[rank\d+\]:[WI]\d{4} ", line)
    ]
    return "\n".join(lines[-150:])


def run_two_ranks(worker: Path | str, args: list[str], out: Path, timeout: float = 180) -> object:
    """Run ``worker args... out`` on 2 ranks; return the JSON rank 0 wrote to ``out``.

    ``worker`` is a script path, or a module name given as ``"-m actplan"``.
    """
    return run_ranks(worker, args, out, nproc=2, timeout=timeout)


def run_ranks(worker: Path | str, args: list[str], out: Path, *, nproc: int, timeout: float = 180) -> object:
    """``run_two_ranks`` on ``nproc`` ranks."""
    # --standalone: a local rendezvous on a port the OS picks, so parallel runs never collide.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [*command, *(worker.split() if isinstance(worker, str) else [str(worker)]), *args, str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and the ranks it started
        stdout, stderr = process.communicate()
        pytest.fail(
            f"{Path(str(worker)).name} {args} timed out after {timeout}s\n"
            f"{_rank_errors(stderr)}\n{stderr[-3000:]}"
        )
    if process.returncode != 0 or not out.exists():
        pytest.fail(
            f"{Path(str(worker)).name} {args} failed (exit {process.returncode})\n{_rank_errors(stderr)}\n"
            f"{stderr[-3000:]}\n{stdout[-2000:]}"
        )
    return json.loads(out.read_text())
