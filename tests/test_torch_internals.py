"""The private torch APIs actplan relies on: all reached through ``actplan._torch_internals``,
each probed once, and a missing or changed one is a clear error, never a plan that quietly
holds more memory."""

import ast
import contextlib
import functools
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import actplan
from actplan import _torch_internals as internals
from actplan._torch_internals import PROBES, TorchInternalsError
from actplan.models import build_model

SRC = Path(actplan.__file__).parent
PRIVATE_ATTRIBUTES = {
    "_cdata",
    "_version",
    "_base",
    "__closure__",
    "weak_holders",
    "_schema",
    "_opname",
    "_compiled_call_impl",
}


@pytest.fixture
def fresh_probes(monkeypatch):
    # Every probe runs again inside the test, as in a new process.
    monkeypatch.setattr(internals, "_passed", set())


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _private_torch_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {alias.name}"
                for alias in node.names
                if alias.name.startswith("torch") and any(p.startswith("_") for p in alias.name.split("."))
            ]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted.startswith("torch.") and not dotted.startswith("torch.ops."):
                if any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:]):
                    found.append(f"line {node.lineno}: {dotted}")
            elif node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"line {node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr", "setattr"}
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in PRIVATE_ATTRIBUTES
        ):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    by_line: dict[str, str] = {}
    for use in found:  # ``torch._C._x`` is also seen as ``torch._C``: one entry per line
        line = use.split(":")[0]
        if len(use) > len(by_line.get(line, "")):
            by_line[line] = use
    return sorted(by_line.values())


def test_no_private_torch_name_is_used_outside_the_internals_module():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if "_torch_internals" in path.relative_to(SRC).parts:
            continue
        uses = _private_torch_uses(path)
        if uses:
            offenders[str(path.relative_to(SRC))] = uses
    assert not offenders, (
        "private torch APIs used outside actplan/_torch_internals (add them there, with a probe):\n"
        + "\n".join(f"{path}: {uses}" for path, uses in offenders.items())
    )


def test_the_scan_sees_each_kind_of_private_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nfrom torch.utils._pytree import tree_map\nimport torch._dynamo\n"
        "n = torch._C._storage_Use_Count\nk = t.untyped_storage()._cdata\nv = t._version\n"
        "op = torch.ops.aten._to_copy.default\nversion = torch.__version__\n"
        "schema = getattr(func, '_schema', None)\n"
    )
    uses = _private_torch_uses(sample)
    assert len(uses) == 6, uses  # neither an aten op name nor torch.__version__ counts


def test_every_probe_passes_on_the_installed_torch(fresh_probes):
    internals.probe()
    assert internals._passed == {each.name for each in PROBES}


def _drop_checkpoint_frame(monkeypatch):
    # As if torch stopped closing its pack hook over the per-call frame.
    original = torch_checkpoint._checkpoint_hook.__init__

    def init(self, frame):
        original(self, frame)
        self.pack_hook = functools.partial(self.pack_hook)

    monkeypatch.setattr(torch_checkpoint._checkpoint_hook, "__init__", init)


def _count_views_no_more(monkeypatch):
    original = torch._C._storage_Use_Count
    monkeypatch.setattr(torch._C, "_storage_Use_Count", lambda key: 1 if original(key) else 0)


BROKEN = {
    "torch._C._storage_Use_Count": lambda mp: mp.delattr(torch._C, "_storage_Use_Count"),
    "torch._C._storage_Use_Count (changed)": _count_views_no_more,
    "torch._C._SetExcludeDispatchKeyGuard": lambda mp: mp.delattr(torch._C, "_SetExcludeDispatchKeyGuard"),
    "torch._C._current_graph_task_id": lambda mp: mp.delattr(torch._C, "_current_graph_task_id"),
    "torch._C._autograd._top_saved_tensors_default_hooks": lambda mp: mp.delattr(
        torch._C._autograd, "_top_saved_tensors_default_hooks"
    ),
    "torch.utils.checkpoint frame": _drop_checkpoint_frame,
    "torch.utils._python_dispatch._disable_current_modes": lambda mp: mp.setattr(
        internals, "disable_current_modes", contextlib.nullcontext
    ),
}


@pytest.mark.parametrize("internal", sorted(BROKEN))
def test_a_missing_or_changed_internal_is_a_clear_error(internal, fresh_probes, monkeypatch):
    BROKEN[internal](monkeypatch)
    with pytest.raises(TorchInternalsError) as caught:
        internals.probe()
    message = str(caught.value)
    assert f"torch {torch.__version__}" in message
    assert "mode 'full'" in message and "please report it" in message
    assert internal.split(" (")[0].split(".")[-1].strip() in message or "frame" in message, message


def test_a_selective_plan_is_refused_at_install_while_full_still_works(fresh_probes, monkeypatch):
    _drop_checkpoint_frame(monkeypatch)
    bundle = build_model("dense", "tiny", n_layers=2)
    with pytest.raises(TorchInternalsError, match="frame"):
        actplan.apply(bundle.model, "matmuls")
    full = build_model("dense", "tiny", n_layers=2)
    actplan.apply(full.model, "full")
    full.model(**full.make_batch(0))["loss"].backward()


def test_a_frame_lost_after_the_probes_passed_is_an_error_in_the_forward(monkeypatch):
    bundle = build_model("dense", "tiny", n_layers=1)
    actplan.apply(bundle.model, "matmuls")  # the probes pass here
    _drop_checkpoint_frame(monkeypatch)
    with pytest.raises(TorchInternalsError, match=r"no torch\.utils\.checkpoint frame"):
        bundle.model(**bundle.make_batch(0))


def test_offload_needs_only_the_dispatch_mode_probe(fresh_probes, monkeypatch):
    _drop_checkpoint_frame(monkeypatch)
    actplan.lowlevel.OffloadEngine()
    assert internals._passed == set(internals.OFFLOAD_PROBES)


def test_probes_run_on_real_tensors_inside_a_fake_run(fresh_probes):
    from actplan.measure import FakeRun

    with FakeRun():
        layer = nn.Linear(4, 4)
        internals.probe()
    assert internals._passed == {each.name for each in PROBES}
    assert layer.weight.shape == (4, 4)


def test_a_module_compiled_under_a_context_enters_it_on_every_call():
    from contextlib import contextmanager

    from actplan._torch_internals import compile_module_under, is_compiled_module

    entered = []

    @contextmanager
    def context():
        entered.append(torch._dynamo.config.capture_scalar_outputs)
        yield

    class Doubled(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 + 1

    module = Doubled()
    compile_module_under(module, {"backend": "eager", "fullgraph": True}, context)
    assert is_compiled_module(module)
    x = torch.randn(2, 4)
    assert torch.equal(module(x), x * 2 + 1)
    module(x)
    assert len(entered) == 2
    torch._dynamo.reset()
