"""The one keep rule (``_engine.ops.keep_decision``) against the table docs/concepts.md states.

Each row of the table has a case here, found by the row's opening words: a row added to the
page without a case, or a case whose row is gone, fails the test, so the page and the function
cannot drift apart.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from actplan._engine.ops import Keep, keep_decision, op_traits

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[1]
X = torch.ones(4, 4)
META = torch.empty(4, 4, device="meta")


def _yes(args, kwargs) -> bool:
    return True


def _no(args, kwargs) -> bool:
    return False


def _never_asked(args, kwargs) -> bool:
    raise AssertionError("reads_held was asked where its answer decides nothing")


# Opening words of a row -> cases: (op, args, kwargs, in_kept, save_collectives, reads_held, expected)
CASES = {
    "expensive op inside an open kept interval": [
        (aten.mm.default, (X, X), {}, True, True, _never_asked, Keep.HOLD),
        (aten.bmm.default, (X[None], X[None]), {}, True, False, _never_asked, Keep.HOLD),
    ],
    "other op inside a kept interval whose inputs are held": [
        (aten.mul.Tensor, (X, X), {}, True, True, _yes, Keep.HOLD),
        (aten._to_copy.default, (X,), {"dtype": torch.bfloat16}, True, True, _yes, Keep.HOLD),
    ],
    "other op inside a kept interval whose inputs the replay rebuilds": [
        (aten.mul.Tensor, (X, X), {}, True, True, _no, Keep.RERUN),
        (aten.silu.default, (X,), {}, True, False, _no, Keep.RERUN),
    ],
    "collective": [
        (aten.topk.default, (X, 2), {}, False, True, _never_asked, Keep.HOLD_ROUTING),
        (aten.topk.default, (X, 2), {}, True, True, _never_asked, Keep.HOLD_ROUTING),
        (aten.bincount.default, (X.long().flatten(),), {}, False, True, _never_asked, Keep.HOLD_ROUTING),
        (aten._to_copy.default, (META,), {"device": "cpu"}, False, True, _never_asked, Keep.HOLD_ROUTING),
        # A collective's floating outputs are held only while read (HOLD, not HOLD_ROUTING).
        (torch.ops._c10d_functional.all_reduce.default, (X, "sum", "0"), {}, False, True, _never_asked,
         Keep.HOLD),
        # save_collectives off: routing outside a kept interval reruns like anything else.
        (aten.topk.default, (X, 2), {}, False, False, _no, Keep.RERUN),
    ],
    "view": [
        (aten.view.default, (X, [16]), {}, True, True, _never_asked, Keep.RERUN),
        (aten.t.default, (X,), {}, True, True, _never_asked, Keep.RERUN),
    ],
    "in-place or `out=` op": [
        (aten.add_.Tensor, (X, X), {}, True, True, _never_asked, Keep.RERUN),
        (aten.empty_like.default, (X,), {}, True, True, _never_asked, Keep.RERUN),
    ],
    "random": [
        (aten.native_dropout.default, (X, 0.5, True), {}, True, True, _never_asked, Keep.RERUN),
        (aten.rand_like.default, (X,), {}, True, True, _never_asked, Keep.RERUN),
    ],
    "anything else": [
        (aten.mul.Tensor, (X, X), {}, False, True, _never_asked, Keep.RERUN),
        (aten.mm.default, (X, X), {}, False, True, _never_asked, Keep.RERUN),
    ],
}

IN_THE_REPLAY = {"never rerun": {Keep.HOLD, Keep.HOLD_ROUTING}, "rerun": {Keep.RERUN}}


def _table_rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "concepts.md").read_text()
    section = text.split("## The policy: what is kept, what is held, what is replayed", 1)[1]
    rows = []
    for line in section.split("### ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("op", "---"):
            rows.append((cells[0], re.sub(r"\s*\(.*\)$", "", cells[1])))
    return rows


def test_every_row_of_the_concepts_table_has_cases_and_every_case_a_row():
    rows = _table_rows()
    assert len(rows) >= 8, rows
    matched = {opening for opening in CASES for op, _ in rows if op.startswith(opening)}
    assert matched == set(CASES), f"cases without a row: {sorted(set(CASES) - matched)}"
    for op, _ in rows:
        assert any(op.startswith(opening) for opening in CASES), f"a row without cases: {op!r}"


@pytest.mark.parametrize("row", [op for op, _ in _table_rows()], ids=lambda op: op[:40])
def test_keep_decision_answers_as_the_table_says(row):
    replay = dict(_table_rows())[row]
    opening = next(o for o in CASES if row.startswith(o))
    for func, args, kwargs, in_kept, collectives, reads_held, expected in CASES[opening]:
        got = keep_decision(op_traits(func), args, kwargs, in_kept, collectives, reads_held)
        assert got is expected, (row, func, in_kept, collectives, got)
        if opening != "collective" or collectives:
            assert got in IN_THE_REPLAY[replay], (row, replay, func, got)


def test_a_random_op_without_dropout_is_not_random():
    # Attention kernels are tagged random but draw only when dropout_p > 0: kept, they hold.
    func = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.ones(1, 1, 4, 8)
    traits = op_traits(func)
    assert keep_decision(traits, (q, q, q), {"dropout_p": 0.0}, True, True, _no) is Keep.HOLD
    assert keep_decision(traits, (q, q, q), {"dropout_p": 0.1}, True, True, _no) is Keep.RERUN
