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


# The line that installs the plan in the Trainer examples of docs/huggingface.md.
APPLY_LINE = 'plan = actplan.apply(model, "matmuls")\nprint(plan.summary())\n'


def run_trainer_example(page: Path, needle: str) -> tuple[dict, dict]:
    """The Trainer example of ``page`` holding ``needle``, run as written and without its
    ``APPLY_LINE``: both namespaces, after checking each trained two steps and the plan
    checkpointed both layers."""
    example = block_with(page, needle)
    if APPLY_LINE not in example:
        raise AssertionError(f"the example holding {needle!r} no longer installs the plan as {APPLY_LINE!r}")
    runs = []
    for code in (example, example.replace(APPLY_LINE, "")):
        namespace: dict = {}
        exec(compile(code, str(page), "exec"), namespace)
        if namespace["trainer"].state.global_step != 2:
            raise AssertionError(f"the example trained {namespace['trainer'].state.global_step} steps, not 2")
        if "plan" in namespace and len(namespace["plan"].checkpointed) != 2:
            raise AssertionError("the example as written did not checkpoint both layers")
        runs.append(namespace)
    return runs[0], runs[1]
