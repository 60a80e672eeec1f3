"""The ``actplan`` argument parser, one function per subcommand, and the checks that run
before any work (the device, the output paths).

Imports the config's preset names, the bench's row names and the model catalogue, not the
command modules: ``main`` (``actplan.cli``) picks the command by name, so a command may build
the parser (``_bench`` does, for its defaults) without an import circle.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import tempfile
from pathlib import Path

from actplan.config import PRESETS
from actplan.devices import resolve_device
from actplan.evaluate.bench import DEFAULT_POLICIES, OFFLOAD_VARIANTS
from actplan.evaluate.contenders import ROOFLINE_GPU
from actplan.measure import ACCELERATORS
from actplan.models import MODELS
from actplan.models import hf as hf_models

SUMMARY = (
    "The actplan command line: estimate (does a real-scale run fit, and with which plan, from a "
    "laptop), bench (every policy measured side by side), plan, profile, verify, explain and units."
)
DEVICE_HELP = "auto (CUDA when there is one), cpu, cuda or cuda:<index>"
MODEL_HELP = (
    f"built-in ({', '.join(MODELS)}), hf-<kind> (a random-weight transformers model; kinds: "
    f"{', '.join(hf_models.REFERENCE_KINDS)}), or package.module:factory"
)
DEFAULT_SIZE = "small"
"""The ``--size`` default of every command but ``bench``."""
BENCH_SIZE = "long"
"""``actplan bench``'s default size: activations dominate the peak, as in LLM training, so its
first table shows memory traded for time (at ``small`` AdamW's state sets most rows' peak)."""
SIZE_HELP = "size of a built-in model (tiny, small, long: activations dominate)"


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help, where there is a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help
        if (
            help_text is None
            or "%(default)" in help_text
            or not action.option_strings
            or action.default in (None, False, [], argparse.SUPPRESS)
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


def _version() -> str:
    try:
        return importlib.metadata.version("actplan")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actplan", description=SUMMARY, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"actplan {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_estimate, _add_bench, _add_explain, _add_profile, _add_plan, _add_verify, _add_units):
        add(sub)
    for subparser in sub.choices.values():
        subparser.formatter_class = _HelpFormatter
    return parser


def _add_bench(sub) -> None:
    parser = sub.add_parser("bench", help="measure every policy side by side on a reference model")
    parser.add_argument("--model", default="dense", help=MODEL_HELP)
    parser.add_argument("--size", default=BENCH_SIZE, help=SIZE_HELP)
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated presets (known: {', '.join(PRESETS)}) and offload rows "
        f"({', '.join(OFFLOAD_VARIANTS)})",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="add a row for a config file (repeatable)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed interleaved rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument(
        "--overhead-repeats",
        type=int,
        default=12,
        help="extra rounds timing full against plain torch.utils.checkpoint (0: none)",
    )
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks (moe only; launch with torchrun --nproc-per-node N -m actplan bench)",
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the plain torch.utils.checkpoint reference row"
    )
    parser.add_argument(
        "--gpu",
        default=ROOFLINE_GPU,
        choices=sorted(ACCELERATORS),
        help="accelerator whose roofline clock prices each row's step (the est. column)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full result as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write a markdown report")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_estimate(sub) -> None:
    parser = sub.add_parser(
        "estimate",
        help="does it fit, and with which plan: memory per GPU and estimated step time of each "
        "preset and plan at a real shape and layout (fake tensors, a roofline clock)",
    )
    parser.add_argument("--shape", help="a shipped shape (llama3-8b, llama3-70b, mixtral-8x7b, ...)")
    parser.add_argument("--hf-config", metavar="PATH", help="a local Hugging Face config.json or its folder")
    parser.add_argument(
        "--titan", metavar="MODEL:FLAVOR", help="torchtitan's own model, e.g. llama3:8B (needs torchtitan)"
    )
    parser.add_argument(
        "--model", choices=("dense", "moe"), help="the reference model, with every number below"
    )
    for name in ("layers", "hidden", "heads", "kv-heads", "head-dim", "ffn", "vocab"):
        parser.add_argument(f"--{name}", type=int, help=f"{name.replace('-', ' ')} (overrides the shape's)")
    for name in ("experts", "top-k", "expert-ffn", "shared-ffn", "first-k-dense"):
        parser.add_argument(f"--{name}", type=int, help=f"MoE: {name.replace('-', ' ')}")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="compute dtype")
    parser.add_argument(
        "--gpu", default="h100", choices=sorted(ACCELERATORS), help="accelerator for the time estimate"
    )
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP ranks the static memory is sharded over")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (with sequence parallel)")
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks, from the FSDP and TP ones (dividing --fsdp x --tp; the real path)",
    )
    parser.add_argument(
        "--presets",
        default="none,full,attn,matmuls,megatron-selective",
        help="comma-separated presets, and what users run today: torch-checkpoint (every layer "
        "whole), titan-op-sac (torchtitan's op-level selective checkpointing), titan-layer-sac:N "
        "(torchtitan's layer-level one: every N-th layer whole)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="N",
        help="GPUs per node (default: the --gpu's, 8): collectives of a group within a node run on "
        "its GPU link, of a group across nodes on the network",
    )
    for flag, field, what in (
        ("--host-link", "host link", "offload's copies (default: the --gpu's, PCIe 5 x16 on most)"),
        ("--gpu-link", "GPU link", "collectives within a node (default: the --gpu's NVLink)"),
        ("--network", "network link", "collectives across nodes, per GPU (default: a 400 Gb/s NIC each)"),
    ):
        parser.add_argument(
            flag,
            metavar="LINK",
            help=f"the {field} for {what}: a name (pcie4, pcie5, nvlink4, ndr, eth-400g, ...) or a rate "
            "such as 25GB/s",
        )
    parser.add_argument(
        "--host-budget",
        metavar="SIZE",
        help="pinned host memory per node that offload may use, e.g. 512GiB (default: the node's "
        "host memory, 2 TB on DGX-class nodes), shared by this job's GPUs on the node",
    )
    parser.add_argument(
        "--optimizer",
        default="AdamW",
        help="the optimizer stepped: a torch.optim class (AdamW, SGD, Adafactor, ...) or an import "
        "path (package.module.Class); its state is what its step allocates",
    )
    parser.add_argument(
        "--optimizer-impl",
        default="foreach",
        choices=("foreach", "fused", "for-loop"),
        help="the optimizer's implementation: foreach (torch's default on a GPU) allocates "
        "temporaries the size of the parameter shards at the step, fused (torchtitan's default) none",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step (each of --batch sequences); the sharded gradients "
        "stay alive between them",
    )
    parser.add_argument(
        "--freeze",
        metavar="REGEX",
        help="freeze the parameters whose names this finds (no gradient, no optimizer state), "
        "e.g. 'embed|norm'",
    )
    parser.add_argument(
        "--alloc-conf",
        metavar="SETTINGS",
        help="the CUDA caching allocator's settings, as PYTORCH_ALLOC_CONF takes them (e.g. "
        "expandable_segments:True); default: PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF, else torch's",
    )
    parser.add_argument(
        "--budget", help="memory per GPU with a unit ('80GiB'): which presets fit, and the plan for it"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="also profile and plan on fake tensors: the plan for --budget, or plans at three "
        "budgets across the feasible range (up to the --gpu's memory)",
    )
    parser.add_argument("--out", metavar="PATH", help="write the plan for --budget (implies --plan)")
    parser.add_argument(
        "--frontier",
        action="store_true",
        help="also the planner's frontier: the fastest predicted plan at each activation budget, "
        "keeping or recomputing only and with offload too",
    )
    parser.add_argument("--plot", metavar="PNG", help="with --frontier: draw both frontiers there")
    parser.add_argument("--json", metavar="PATH", help="write the estimate as JSON")
    parser.add_argument(
        "--workers",
        type=int,
        help="processes stepping the presets at once (default: ACTPLAN_WORKERS, else the usable "
        "cores); 1 steps them one after another here",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def _add_explain(sub) -> None:
    parser = sub.add_parser("explain", help="print the per-layer plan a config resolves to")
    parser.add_argument("--model", default="dense", help=MODEL_HELP)
    parser.add_argument("--size", default=DEFAULT_SIZE, help=SIZE_HELP)
    parser.add_argument("--config", required=True, help="preset name or YAML/JSON file")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also run a training step and report, per layer and kept unit, the bytes held at the "
        "end of forward against what autograd keeps for the same ops without checkpointing",
    )


def _add_profile_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dense", help=MODEL_HELP)
    parser.add_argument("--size", default=DEFAULT_SIZE, help=SIZE_HELP)
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per measurement")
    parser.add_argument("--min-bytes", default="64KiB", help="offload size threshold of offload candidates")
    parser.add_argument(
        "--bandwidth",
        help="host link bandwidth per direction, bytes/s (e.g. 25GB): replaces the measured figure "
        "in offload's charge",
    )
    parser.add_argument("--cache-dir", help="profile cache (default ~/.cache/actplan/profiles)")
    parser.add_argument("--refresh", action="store_true", help="profile again even if cached")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def _add_profile(sub) -> None:
    parser = sub.add_parser("profile", help="measure each layer type's keep/recompute/offload candidates")
    _add_profile_options(parser)


def _add_plan(sub) -> None:
    parser = sub.add_parser("plan", help="the fastest plan under a memory budget: solve, write, run, check")
    _add_profile_options(parser)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--budget",
        help="bytes with a unit ('40GiB', '1.5GB') or a share of the no-checkpoint peak ('60%%')",
    )
    target.add_argument(
        "--sweep",
        action="store_true",
        help="print every plan on the predicted memory/time front (no budget needed; nothing is run)",
    )
    parser.add_argument(
        "--out",
        help="where to write the plan (YAML or JSON); default plan.yaml here, numbered (plan-1.yaml, "
        "...) when that file exists: only a file named here is replaced",
    )
    parser.add_argument(
        "--plot", help="Pareto plot (PNG); default pareto.png here, numbered like --out; '' for none"
    )
    parser.add_argument("--no-run", action="store_true", help="solve and write only")
    parser.add_argument(
        "--host-budget",
        metavar="SIZE",
        help="pinned host memory the plan's offload may use, e.g. 64GiB (default: no bound)",
    )
    parser.add_argument(
        "--budget-of",
        choices=("reserved", "requested"),
        help="what --budget bounds: reserved (the default on CUDA: the caching allocator's segments, "
        "what a run runs out of, modelled from the plan's allocation trace under PYTORCH_ALLOC_CONF) "
        "or requested (the default elsewhere: the bytes tensors ask for)",
    )


def _add_verify(sub) -> None:
    parser = sub.add_parser("verify", help="run a plan next to no checkpointing and compare every step")
    parser.add_argument("--model", default="dense", help=MODEL_HELP)
    parser.add_argument("--size", default=DEFAULT_SIZE, help=SIZE_HELP)
    parser.add_argument("--config", required=True, help="preset name or YAML/JSON file")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to compare")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument(
        "--atol", type=float, default=0.0, help="tolerance for losses and gradients (0: bit-identical)"
    )
    parser.add_argument(
        "--check-recompute",
        action="store_true",
        help="also compare every replayed op with its forward value (keeps a copy of the layers' op outputs)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def _add_units(sub) -> None:
    parser = sub.add_parser("units", help="list the recompute units (all, or those a model declares)")
    parser.add_argument("--model", help="only the units this model declares (any --model form)")
    parser.add_argument(
        "--size", default=DEFAULT_SIZE, help="size of a built-in model given with --model (tiny, small, long)"
    )


_OUTPUT_OPTIONS = (("json", "--json"), ("markdown", "--markdown"), ("out", "--out"), ("plot", "--plot"))


def _unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written (its missing folders are made on writing); None if it can.

    Probes by writing: permission bits say nothing for root, nor about file systems such as
    ``/proc`` that refuse new files. An existing file is opened for appending (its contents
    stay); otherwise a scratch file is made and removed in the deepest folder that exists."""
    if path.is_dir():
        return "it is a directory; give a file path"
    if path.exists():
        try:
            with open(path, "a"):
                pass
        except OSError as err:
            return f"the file is not writable ({err.strerror or err})"
        return None
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{str(folder)!r} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"cannot create files in {str(folder)!r} ({err.strerror or err})"
    return None


def check_arguments(args: argparse.Namespace) -> None:
    """What can be checked before any work: the device, the output paths, an option that
    would do nothing."""
    if getattr(args, "device", None) is not None:
        resolve_device(args.device)
    if getattr(args, "sweep", False) and getattr(args, "budget_of", None):
        raise ValueError("--budget-of applies to a plan for --budget; --sweep plans for no budget: drop one")
    for attribute, option in _OUTPUT_OPTIONS:
        if getattr(args, attribute, None):
            why = _unwritable(Path(getattr(args, attribute)))
            if why is not None:
                raise ValueError(
                    f"cannot write {option} {getattr(args, attribute)!r}: {why}; choose another path "
                    "(checked before any work)"
                )
