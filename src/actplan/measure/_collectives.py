"""What a collective costs and where it runs: the time of one all-gather, reduce-scatter,
all-reduce or all-to-all on a link, and the streams of a training step (``Streams``) that decide
how much of it the compute waits for.

Costs are the bandwidth terms of the standard algorithms, per rank, for ``n`` ranks and the
bytes ``S`` named below, over a link of ``B`` bytes/s in one direction:

* all-gather (ring): ``(n - 1) / n * S / B``, ``S`` the gathered output;
* reduce-scatter (ring): ``(n - 1) / n * S / B``, ``S`` the full input;
* all-reduce (ring: a reduce-scatter, then an all-gather): ``2 (n - 1) / n * S / B``;
* all-to-all (pairwise): ``(n - 1) / n * S / B``, ``S`` the larger of what a rank sends and
  receives.

No latency term: at the message sizes of LLM training (megabytes per layer) bandwidth sets the
time. A group inside one node runs on the node's GPU link; a group that spans nodes on the
network, one NIC per GPU. Pure logic; imports nothing from torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Collective", "Streams", "collective_seconds", "spans_nodes"]


class Collective(Enum):
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    ALL_TO_ALL = "all-to-all"


_PASSES = {
    Collective.ALL_GATHER: 1.0,
    Collective.REDUCE_SCATTER: 1.0,
    Collective.ALL_REDUCE: 2.0,
    Collective.ALL_TO_ALL: 1.0,
}


def collective_seconds(kind: Collective, nbytes: int, ranks: int, bytes_per_s: float) -> float:
    """Seconds one rank spends in ``kind`` over ``ranks`` ranks, for the bytes the module doc
    names, on a link of ``bytes_per_s`` in one direction. One rank moves nothing."""
    if ranks < 1 or bytes_per_s <= 0:
        raise ValueError(f"a collective needs a rank and a positive link, got {ranks}, {bytes_per_s}")
    return _PASSES[kind] * (ranks - 1) / ranks * nbytes / bytes_per_s


def spans_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    """Whether a group of global ``ranks`` spans more than one node of ``gpus_per_node`` GPUs
    (ranks are numbered node by node)."""
    return len({rank // gpus_per_node for rank in ranks}) > 1


@dataclass
class Streams:
    """The streams of one rank's step, in seconds from its start.

    * Compute (``compute``) and the collectives the program waits for at once (``blocking``:
      tensor parallelism's, expert parallelism's all-to-all) add to the compute stream.
    * FSDP's all-gathers (``gather``) run on their own stream, each issued one unit ahead: it
      starts once the stream is free and the unit before it has started computing, and the
      compute waits for it to finish before the unit runs (FSDP2's prefetch, by the CPU running
      ahead in forward and explicitly in backward).
    * FSDP's reduce-scatters (``reduce``) start once the gradients they reduce are computed and
      their own stream is free; nothing waits for them but the end of the step.

    * Offload's copies (``copy_out``, ``copy_in``, ``use``) run on a copy-out and a copy-in
      stream: a copy-out starts once its tensor exists (now) and the stream is free; a reload
      once it is asked for (now: the engine prefetches a layer ahead), its copy-out has ended and
      the stream is free; the compute waits for a reload where it first uses it.

    The streams share links without slowing each other (no contention modelled).

    ``end`` is the step time; ``exposed`` the part of it that is not compute: blocking
    collectives, the waits for all-gathers and reloads, and streams still running at the end;
    ``exposed_copies`` the offload copies' share of it.
    """

    compute_seconds: float = 0.0
    blocking_seconds: float = 0.0
    _compute: float = 0.0
    _gathers: float = 0.0  # where the all-gather stream is free
    _reduces: float = 0.0  # where the reduce-scatter stream is free
    _outs: float = 0.0  # where the copy-out stream is free
    _ins: float = 0.0  # where the copy-in stream is free
    copy_wait_seconds: float = 0.0
    _last_unit_start: float | None = None
    waits: list[float] = field(default_factory=list)

    def compute(self, seconds: float) -> None:
        self._compute += seconds
        self.compute_seconds += seconds

    def blocking(self, seconds: float) -> None:
        self._compute += seconds
        self.blocking_seconds += seconds

    def gather(self, seconds: float) -> None:
        issued = self._compute if self._last_unit_start is None else self._last_unit_start
        done = max(self._gathers, issued) + seconds
        self._gathers = done
        if done > self._compute:
            self.waits.append(done - self._compute)
            self._compute = done
        self._last_unit_start = self._compute

    def reduce(self, seconds: float) -> None:
        self._reduces = max(self._reduces, self._compute) + seconds

    def copy_out(self, seconds: float) -> float:
        """A copy-out issued now; returns when it ends."""
        self._outs = max(self._outs, self._compute) + seconds
        return self._outs

    def copy_in(self, seconds: float, after: float) -> float:
        """A reload issued now, of a copy-out that ends at ``after``; returns when it ends."""
        self._ins = max(self._ins, self._compute, after) + seconds
        return self._ins

    def use(self, ready: float) -> None:
        """The compute reads a reload that ends at ``ready``."""
        if ready > self._compute:
            self.copy_wait_seconds += ready - self._compute
            self._compute = ready

    @property
    def end(self) -> float:
        return max(self._compute, self._gathers, self._reduces, self._outs, self._ins)

    @property
    def exposed_copies(self) -> float:
        """The copies' share of ``exposed``: waits for reloads, and copies still running when
        everything else has ended."""
        others = max(self._compute, self._gathers, self._reduces)
        return self.copy_wait_seconds + max(self._outs - others, self._ins - others, 0.0)

    @property
    def exposed(self) -> float:
        return self.end - self.compute_seconds
