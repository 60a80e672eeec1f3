"""The README's Python tour runs as written, and its claim of identical gradients holds."""

import re
from pathlib import Path

import torch

import actplan

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run_and_are_exact():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    model_cls = namespace["Model"]

    def grads(config):
        torch.manual_seed(0)
        model = model_cls()
        if config is not None:
            actplan.apply(model, config)
        torch.manual_seed(1)
        model(torch.randn(8, 32, requires_grad=True)).backward()
        return [p.grad for p in model.parameters()]

    baseline = grads(None)
    for config in ("full", {"mode": "selective", "keep": ["mlp_up"], "layers": "0-2"}):
        assert all(torch.equal(a, b) for a, b in zip(grads(config), baseline, strict=True))
