"""The Python blocks of a documentation page, for the tests that run them as written."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(page: Path) -> list[str]:
    """Every fenced ```python block of ``page``, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def block_with(page: Path, needle: str) -> str:
    """The one Python block of ``page`` that contains ``needle``."""
    (block,) = [b for b in python_blocks(page) if needle in b]
    return block
