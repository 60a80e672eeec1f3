"""Our predictions next to published measurements of real GPU training memory.

Each case re-creates a published run on paper (model shape, layout, sequences per GPU,
checkpointing, allocator settings) and runs ``actplan.planning.estimate`` for it; the table
in ``bench/results/published.md`` gives the published figure, ours for the same metric, and
the error. Nothing here is fitted to these figures: they are only compared.

    python -m bench.published            # writes bench/results/published.md
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from actplan.measure import AllocatorSettings
from actplan.models.shape import Shape, load_shape
from actplan.planning.estimate import TrainingSetup, estimate

GIB = 2**30
QWEN3_32B = Shape(
    layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128, ffn=25600, vocab=151936, name="qwen3-32b"
)  # Qwen/Qwen3-32B config.json


@dataclass
class Case:
    key: str
    source: str
    shape: Shape
    preset: str
    published_gib: float
    fsdp: int = 8
    tp: int = 1
    alloc_conf: str = ""
    optimizer_impl: str = "foreach"  # torchtitan's default until 2025-02-24 (#881), fused after
    titan: str | None = None  # torchtitan's MODEL:FLAVOR, estimated with its own code too


def _llama(batch: int, seq: int = 8192) -> Shape:
    return load_shape("llama3-8b", seq=seq, batch=batch, dtype="bf16")


def _qwen(batch: int) -> Shape:
    from dataclasses import replace

    return replace(QWEN3_32B, seq=4096, batch=batch)


EXPANDABLE = "expandable_segments:True"  # torchtitan's launch script, from 2024-10-22 on
# torchtitan's runs from 2025-02-24 on (#881) step a fused AdamW; earlier ones torch's default
# on a GPU, foreach.
LATE_2024 = {"alloc_conf": EXPANDABLE}
SINCE_2025_03 = {"alloc_conf": EXPANDABLE, "optimizer_impl": "fused"}
LLAMA, QWEN = {"titan": "llama3:8B"}, {"titan": "qwen3:32B"}  # the code torchtitan trains
TITAN = "torchtitan"
QWEN_PR = f"{TITAN} PR #1690, Qwen3 32B training configs"
CASES = [
    Case("E1", f"{TITAN} docs/performance.md (2024-12), Table 1: 8xH100, eager", _llama(2),
         "titan-op-sac", 82.4, 8, **LATE_2024, **LLAMA),
    Case("E2", f"{TITAN} docs/performance.md (2024-12), Table 3: 128xH100, eager", _llama(2),
         "titan-op-sac", 67.0, 128, **LATE_2024, **LLAMA),
    Case("E3", f"{TITAN} PR #822 (reshard_after_forward default), 8xH100", _llama(1),
         "titan-op-sac", 49.59, 8, **LATE_2024, **LLAMA),
    Case("E6", f"{TITAN} PR #467 (no-AC baseline), 8xH100, before expandable segments", _llama(1),
         "none", 78.38, 8, **LLAMA),
    Case("E8a", QWEN_PR, _qwen(1), "full", 81.47, 8, **SINCE_2025_03, **QWEN),
    Case("E8b", QWEN_PR, _qwen(2), "full", 89.33, 8, **SINCE_2025_03, **QWEN),
    Case("E8c", QWEN_PR, _qwen(4), "full", 78.48, 16, **SINCE_2025_03, **QWEN),
    Case("T1", f"{TITAN} PR #364 (A100 80GB inferred), before expandable segments", _llama(4),
         "titan-op-sac", 65.53, 2, tp=4, **LLAMA),
    Case("T2", f"{TITAN} PR #364, earlier revision (lbs 1, the config default)", _llama(1),
         "titan-op-sac", 30.98, 2, tp=4, **LLAMA),
    Case("T3a", QWEN_PR, _qwen(16), "full", 43.45, 4, tp=8, **SINCE_2025_03, **QWEN),
    Case("T3b", QWEN_PR, _qwen(32), "full", 70.79, 4, tp=8, **SINCE_2025_03, **QWEN),
    Case("T3c", QWEN_PR, _qwen(32), "full", 63.27, 8, tp=8, **SINCE_2025_03, **QWEN),
    Case("T3d", QWEN_PR, _qwen(16), "full", 70.20, 8, tp=4, **SINCE_2025_03, **QWEN),
    Case("C3", f"{TITAN} docs/performance.md (2024-12), Table 4: compile and float8 (not modelled)",
         load_shape("llama3-70b", seq=8192, batch=16, dtype="bf16"), "full", 71.9, 32, tp=8,
         **LATE_2024, titan="llama3:70B"),
]  # fmt: skip


NOTES = """\
## What the comparison says

- **Source of every published figure**: each case names it; the configurations were read from
  the run's own config or PR text. Where a source leaves something out (the GPU of T1/T2, the
  batch of T2), the case says what was inferred.
- **How ours is made**: `actplan.planning.estimate` with the preset named, the layout's FSDP and
  TP degrees, the run's allocator settings and AdamW implementation, the H100's memory. Dense
  layouts run through the real code path (FSDP2, TP with sequence parallelism and loss
  parallel, on torch's fake process group); the figure is the caching-allocator model's peak
  reserved bytes over the two steps.
- **Two codes.** 'ours' steps actplan's reference decoder (QK-norms, which Llama 3 lacks; its
  own RoPE and RMSNorm). 'torchtitan's code' steps torchtitan's own model of the flavour
  (`--titan llama3:8B`, `qwen3:32B`, `llama3:70B`: complex fp32 RoPE, fused QKV, its RMSNorm
  and its fp32 loss), SDPA standing in for FlexAttention; under TP it is split by torchtitan's
  own tensor parallelism (its sharding declarations on its `partial_dtensor` path: a
  vocabulary-parallel embedding, its loss-parallel cross-entropy), then sharded by
  `actplan.parallelize`'s FSDP2. It is torchtitan 0.3's code, not the code of each run's date
  (2024 and 2025).
- **Where the two codes differ: torchtitan 0.3 keeps a RoPE table in every layer.** Each
  attention's `rope.cache` is a buffer of its own, which FSDP does not shard: 64 MiB per layer
  for Llama 3 (131,072 positions x 64 complex64), 40 MiB for Qwen3 (40,960 x 256 fp32), so
  2 GiB on llama3-8b, 2.5 GiB on qwen3-32b and 5 GiB on llama3-70b per GPU. That is the 2-3 GiB
  torchtitan's code holds above the reference decoder with checkpointing (checked on qwen3-32b
  cut to 2 and 4 layers: 40 MiB more resident per layer, the same activations). The runs of
  2024-2025 held one table for the whole model, so on the Qwen3 TP runs (T3) torchtitan's code
  is 4.8-6.9% over where the reference decoder is within 3%. Without checkpointing (E6) it holds
  1.4 GiB less than the reference decoder despite the tables; that difference was not traced.
- **Within 5%**, of the 13 eager cases (C3 apart): the reference decoder 10 (all but E6, E8c
  and T2), torchtitan's code 8 (all but E6, E8c, and T3a, T3c, T3d, 0.2-1.9 points over: above).
  With torchtitan's own TP, T2 comes within 5% (-3.0%; -10.7% with the reference decoder, whose
  split of the model is actplan's), and T1 moves from -4.9% to -2.0%.
- **E6 (no checkpointing) stays a miss with either code** (+16.4%, +14.6%): every tensor the
  forward saves counts there, so it is the case most sensitive to the code of its date
  (2024-07); the cause is not found.
- **Tensor parallel runs** (T1-T3, C3): until stop 45 they were 17-28% under: the memory meter,
  a dispatch mode, is off the stack while DTensor runs an op, so what DTensor's own handlers
  allocate went unseen, above all the loss-parallel cross-entropy's fp32 copies of the
  vocabulary-sharded logits (the shifted logits, their exponential, the gradient it builds).
  The meter now steps aside for a DTensor op with a window of its own on the stack and counts
  those temporaries, and does not count the global-shape tensors DTensor makes to propagate
  shapes. The gloo exactness tests had compared meter with meter, so both sides shared the
  blind spot; a test now checks the handler's temporaries against their known size.
- **C3 used torch.compile and float8**, which the estimate does not model; it is listed, not
  counted toward the eager goal. It is the llama3-70b FSDP 32 x TP 8 run the estimate once put
  at +173% (one rank's layer over the whole sequence), then at -27% (the blind spot above).
- **Nothing here was fitted**: no constant of the estimate was chosen by looking at these
  figures. The CUDA context and NCCL's buffers are outside `reserved_bytes.all.peak`, so they
  are not part of this comparison.
"""


def _reserved(case: Case, shape: Shape) -> tuple[float, float]:
    """Our allocated and reserved peaks (GiB) for the case's run of ``shape``."""
    settings = AllocatorSettings.parse(case.alloc_conf) if case.alloc_conf else AllocatorSettings()
    result = estimate(
        shape,
        (case.preset,),
        gpu="h100",
        fsdp=case.fsdp,
        tp=case.tp,
        allocator=settings,
        training=TrainingSetup(optimizer_impl=case.optimizer_impl),
    )
    row = result.rows[0]
    return row.allocated_peak_bytes / GIB, row.reserved_peak_bytes / GIB


def main() -> int:
    out = Path(__file__).parent / "results" / "published.md"
    rows = []
    for case in CASES:
        started = time.perf_counter()
        allocated, ours = _reserved(case, case.shape)
        error = ours / case.published_gib - 1
        titan = None
        if case.titan:
            from actplan.models.titan import shape_from_titan

            shape = shape_from_titan(
                case.titan, seq=case.shape.seq, batch=case.shape.batch, dtype=case.shape.dtype
            )
            titan = _reserved(case, shape)[1]
        rows.append((case, ours, allocated, error, titan))
        took = time.perf_counter() - started
        theirs = (
            ""
            if titan is None
            else f"; torchtitan's code {titan:.2f} GiB ({titan / case.published_gib - 1:+.1%})"
        )
        ours_text = f"ours {ours:.2f} GiB ({error:+.1%}){theirs}"
        print(f"{case.key}: published {case.published_gib:.2f} GiB, {ours_text}, {took:.0f} s")
    lines = [
        "# Predicted vs published: peak reserved memory per GPU",
        "",
        "`python -m bench.published` (torch 2.13, CPU, fake tensors; the estimate's own code, nothing",
        "fitted). Every published figure is the peak *reserved* bytes: torchtitan's `memory:` log line",
        "is `torch.cuda.memory_stats()['reserved_bytes.all.peak']` (`torchtitan/components/metrics.py`).",
        "Ours is the caching-allocator model's reserved peak for the same run under the allocator",
        "settings that run used (torchtitan's launch script sets `expandable_segments:True` from",
        "2024-10-22 on). Local batch is sequences per data-parallel rank. `titan-op-sac` is",
        "torchtitan's op-level selective checkpointing re-stated (attention, reduce-scatter and",
        "all-to-all saved, and every other matmul). 'ours' steps actplan's reference decoder at each",
        "shape; 'torchtitan's code' steps torchtitan's own model of the flavour (under TP split by",
        "its own TP; `--titan`, torchtitan 0.3's code, SDPA for FlexAttention): see the notes below.",
        "",
        "| case | source | model, layout, local batch x seq | checkpointing | allocator | AdamW "
        "| published | ours: allocated | ours: reserved | error | torchtitan's code: reserved | error |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, ours, allocated, error, titan in rows:
        layout = f"FSDP {case.fsdp}" + (f" x TP {case.tp} + SP" if case.tp > 1 else "")
        theirs = (
            "| | "
            if titan is None
            else f"| {titan:.2f} GiB ({case.titan}) | {titan / case.published_gib - 1:+.1%} |"
        )
        lines.append(
            f"| {case.key} | {case.source} | {case.shape.name}, {layout}, {case.shape.batch} x "
            f"{case.shape.seq} | {case.preset} | {case.alloc_conf or 'defaults'} | {case.optimizer_impl} | "
            f"{case.published_gib:.2f} GiB | {allocated:.2f} GiB | {ours:.2f} GiB | {error:+.1%} " + theirs
        )
    lines += ["", NOTES]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
