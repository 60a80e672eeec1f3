"""Lower bounds on the seconds that the layers a partial plan has not chosen yet add, for the
frontier walks of ``_frontier``: exact lower bounds, used only to drop partial plans that
cannot beat a target, never to change an answer.

Two bounds, the larger one used. The LP bound relaxes the choice to the convex hull of each
layer's (retained, seconds) points and keeps one capacity, the backward-start phase. The
stage bound keeps every layer's own phase under the budget as well (its gradients, transient
bytes and measured calibration terms), which the LP bound cannot see: per layer and per
price of a retained byte, the least seconds minus price times bytes of every plan of the
rest, each layer's candidates limited to what its phase allows (see ``_stage``).

Private to the planner's solver. Imports numpy and the problem records (annotations only).
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from actplan.planning._records import PlanProblem

# Prices of a retained byte the stage bound is kept at: a geometric ladder this fine.
PRICE_STEP = 1.1
# Points at which a bound's lines are sampled to find those that matter in a layer's range.
SAMPLES = 64


class Costs:
    """A (reduced) problem as arrays: each layer's candidates' costs, each layer's backward
    phase bytes that no choice changes (``fixed``), and the bounds that need no budget."""

    def __init__(self, problem: PlanProblem) -> None:
        columns = [
            np.array([(c.retained_bytes, c.transient_bytes, c.extra_seconds, c.offloaded_bytes) for c in cs])
            for cs in problem.layers
        ]
        self._columns = [tuple(np.ascontiguousarray(col[:, f]) for f in range(4)) for col in columns]
        self.layers = len(columns)
        self.depth = problem.prefetch_layers
        base = problem.static_bytes + problem.backward_extra_bytes
        after = [a + e for a, e in zip(problem.grads_after(), problem.extras(), strict=True)]
        self.fixed = np.array([base + problem.other_grad_bytes + a for a in after])
        self.start_phase = base + problem.nonlayer_bytes + problem.head_transient_bytes
        self.optimizer_phase = problem.optimizer_phase_bytes
        # The host budget (with a hair of slack for rounding), and whether the walks must carry
        # each partial plan's offloaded total: only when some plan could break it.
        host = problem.host_budget_bytes
        self.host_cap = np.inf if host is None else host * (1 + 1e-9) + 1
        most_moved = sum(float(col[:, 3].max()) for col in columns)
        self.hosted = bool(most_moved > self.host_cap)
        least = np.array([col[:, 0].min() for col in columns])
        self.least_prefix = np.r_[0.0, np.cumsum(least)]  # [j]: least retained by layers 0..j-1
        self.least_suffix = np.r_[np.cumsum(least[::-1])[::-1], 0.0]  # [j]: by layers j..n-1
        hulls = [_lower_hull(col[:, 0], col[:, 2]) for col in columns]
        self.suffix_lp = _lp_tables(reversed(hulls))[::-1]  # [j]: layers j..n-1
        self.prefix_lp = _lp_tables(hulls)  # [j]: layers 0..j-1
        self.prices = _price_ladder(hulls)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def of(problem: PlanProblem) -> Costs:
        """The arrays of ``problem``, kept for the next solve of the same problem."""
        return Costs(problem)

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Layer ``i``'s candidates: retained, transient, seconds, offloaded."""
        return self._columns[i]  # type: ignore[return-value]

    def seconds(self, choices: Sequence[int]) -> float:
        return float(sum(self._columns[i][2][c] for i, c in enumerate(choices)))


def _lower_hull(retained: np.ndarray, seconds: np.ndarray) -> list[tuple[float, float]]:
    """The lower-left convex hull of a layer's (retained bytes, extra seconds) points."""
    hull: list[tuple[float, float]] = []
    for x, y in sorted(set(zip(retained.tolist(), seconds.tolist(), strict=True))):
        if hull and y >= hull[-1][1]:
            continue  # more bytes for no less time: never on the lower-left hull
        while len(hull) >= 2 and (
            (hull[-1][0] - hull[-2][0]) * (y - hull[-2][1]) <= (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
        ):
            hull.pop()
        hull.append((x, y))
    return hull


def _lp_tables(hulls: Iterable[list[tuple[float, float]]]) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """For the first 0, 1, 2, ... layers of ``hulls``, the LP relaxation of choosing one point
    of each at most ``c`` retained bytes in all (segments taken steepest first), as
    ``(least, bytes, seconds)``: the bound at ``c`` is ``interp(c - least, bytes, seconds)``,
    infinite below ``least``."""
    out = [(0.0, np.zeros(1), np.zeros(1))]
    least = seconds = 0.0
    widths: list[float] = []
    drops: list[float] = []
    for hull in hulls:
        least += hull[0][0]
        seconds += hull[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(hull):
            widths.append(x1 - x0)
            drops.append(y0 - y1)
        width, drop = np.array(widths), np.array(drops)
        order = np.argsort(-drop / np.maximum(width, 1e-300), kind="stable")
        out.append((least, np.r_[0.0, np.cumsum(width[order])], seconds - np.r_[0.0, np.cumsum(drop[order])]))
    return out


def _lp(table: tuple[float, np.ndarray, np.ndarray], room: np.ndarray) -> np.ndarray:
    least, widths, seconds = table
    return np.where(room >= least, np.interp(room - least, widths, seconds), np.inf)


def _price_ladder(hulls: list[list[tuple[float, float]]]) -> np.ndarray:
    """Zero, and a geometric ladder of prices (seconds per retained byte) from a quarter of the
    flattest hull segment's to four times the steepest's."""
    slopes = [(y0 - y1) / (x1 - x0) for hull in hulls for (x0, y0), (x1, y1) in itertools.pairwise(hull)]
    if not slopes:
        return np.zeros(1)
    low, high = min(slopes) / 4, max(slopes) * 4
    steps = int(np.ceil(np.log(high / low) / np.log(PRICE_STEP)))
    return np.r_[0.0, low * PRICE_STEP ** np.arange(steps + 1)]


class _Lines:
    """Per layer, the lines ``a + price * x`` (``sign`` +1) or ``a - price * x`` (-1) that bound a
    function below, kept as the vertices of their upper envelope over the layer's range."""

    def __init__(self, intercepts: np.ndarray, prices: np.ndarray, sign: float, ranges: np.ndarray) -> None:
        self.vertices: list[tuple[np.ndarray, np.ndarray]] = []
        for a, (lo, hi) in zip(intercepts, ranges, strict=True):
            if not (np.isfinite(a).all() and lo <= hi):  # no state can be here, or none completes
                self.vertices.append((np.array([lo]), np.array([np.inf])))
                continue
            grid = np.linspace(lo, hi, SAMPLES + 1)
            # The lines on top at the samples, by rising slope: each is on the envelope of
            # these, so consecutive ones meet at its vertices. Any subset of the lines bounds
            # below as well: a line the samples miss costs tightness, not validity.
            active = np.unique(np.argmax(a + sign * prices * grid[:, None], axis=1))[:: int(sign)]
            slope, intercept = sign * prices[active], a[active]
            crossings = (intercept[:-1] - intercept[1:]) / (slope[1:] - slope[:-1])
            xs = np.maximum.accumulate(np.clip(np.concatenate(([lo], crossings, [hi])), lo, hi))
            self.vertices.append((xs, (intercept + slope * xs[:, None]).max(axis=1)))

    def at(self, i: int, x: np.ndarray) -> np.ndarray:
        xs, ys = self.vertices[i]
        return np.interp(x, xs, ys)


def _envelope_at(intercepts: np.ndarray, slopes: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The largest of the lines at each ``x``, and that line's slope."""
    values = intercepts + slopes * x[:, None]
    best = values.argmax(axis=1)
    return values[np.arange(len(x)), best], slopes[best]


def _stage(costs: Costs, limit: np.ndarray, caps: np.ndarray, total: float, backward: bool) -> np.ndarray:
    """Intercepts of the stage bound, one row per boundary, one column per price ``p``.

    Forward walks (``backward`` False): row ``j`` bounds the seconds of layers ``j..n-1`` after
    a prefix of ``S`` bytes by ``max_p(row[p] + p * S)``. Row ``n`` is ``-p * total``: no layer
    left, and ``S`` at most ``total``. Going back a layer, each candidate ``c`` of layer ``j``
    takes ``S + r_c`` into layer ``j + 1``'s bound, for the ``S`` its phase allows (within
    ``caps``, above the least prefix); the least over those ``S`` of ``s_c + bound(S + r_c) - p*S``
    is the new intercept (at an end of the range, or the old intercept where the bound's slope
    crosses ``p``). Backward walks (``backward`` True): row ``j`` bounds layers ``0..j-1`` when
    they may hold at most ``X`` bytes, by ``max_p(row[p] - p * X)``, built the same way forwards.
    Relaxed only in reloads (taken as zero) and in convexity, so every line stays below the
    exact least seconds.
    """
    prices, n = costs.prices, costs.layers
    sign = -1.0 if backward else 1.0
    rows = np.empty((n + 1, len(prices)))
    rows[0 if backward else n] = 0.0 if backward else -prices * total
    rt_least = [(r + t).min() for r, t, _, _ in (costs.layer(i) for i in range(n))]
    order = range(n) if backward else range(n - 1, -1, -1)
    for j in order:
        retained, transient, seconds, offloaded = costs.layer(j)
        # Per candidate, the most bytes layers 0..j may hold: its phase, the next layer's
        # (with what it offloads reloaded there) and a completion all need room.
        high = np.minimum(limit[j] - transient, caps[j])
        if costs.depth and j + 1 < n:
            high = np.minimum(high, limit[j + 1] - offloaded - rt_least[j + 1])
        if backward:
            high, low = high - retained, np.full(len(retained), costs.least_prefix[j])
        else:
            low = costs.least_prefix[j] + retained
        old = rows[j] if backward else rows[j + 1]
        slope = sign * prices
        top, top_slope = _envelope_at(old, slope, high)
        bottom, bottom_slope = _envelope_at(old, slope, low)
        # min over [low, high] of bound(y) - slope*y: at high if still falling there, at low if
        # already rising there, else no lower than the old intercept.
        least = np.where(
            top_slope[:, None] <= slope,
            top[:, None] - slope * high[:, None],
            np.where(bottom_slope[:, None] >= slope, bottom[:, None] - slope * low[:, None], old),
        )
        value = seconds[:, None] + prices * retained[:, None] + least
        value[low > high] = np.inf
        rows[j + 1 if backward else j] = value.min(axis=0)
    return rows


class Bounds:
    """Lower bounds for the walks of one solve under ``budget``: ``after(i, S)`` on the seconds
    of layers ``i+1..`` for forward states after layer ``i`` holding ``S`` retained bytes;
    ``before(j, X)`` on the seconds of layers ``0..j-1`` for backward states that leave them
    ``X`` bytes; ``cap[i]``, the most bytes a prefix through layer ``i`` may hold and still be
    completed (reloads aside); ``lowest``, the bound on a whole plan."""

    def __init__(self, costs: Costs, budget: float) -> None:
        n = costs.layers
        self.costs = costs
        limit = budget - costs.fixed
        self.total = budget - costs.start_phase  # the most retained bytes of the whole plan
        cap = np.empty(n)
        cap[-1] = self.total
        for i in range(n - 2, -1, -1):
            retained, transient, _, _ = costs.layer(i + 1)
            cap[i] = np.max(np.minimum(cap[i + 1] - retained, limit[i + 1] - transient - retained))
        self.cap = cap
        self._after = self._before = None
        if np.isfinite(budget):  # else no phase binds: the LP bound is the whole story
            after = _stage(costs, limit, cap, self.total, backward=False)
            before = _stage(costs, limit, cap, self.total, backward=True)
            forward_ranges = np.c_[costs.least_prefix, np.r_[0.0, cap]]
            backward_ranges = np.c_[costs.least_prefix, self.total - costs.least_suffix]
            self._after = _Lines(after, costs.prices, 1.0, forward_ranges)
            self._before = _Lines(before, costs.prices, -1.0, backward_ranges)
        self.lowest = float(self.after(-1, np.zeros(1))[0])

    def after(self, i: int, prefix: np.ndarray) -> np.ndarray:
        lp = _lp(self.costs.suffix_lp[i + 1], self.total - prefix)
        return lp if self._after is None else np.maximum(lp, self._after.at(i + 1, prefix))

    def before(self, j: int, room: np.ndarray) -> np.ndarray:
        lp = _lp(self.costs.prefix_lp[j], room)
        return lp if self._before is None else np.maximum(lp, self._before.at(j, room))
