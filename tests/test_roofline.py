"""The roofline clock: FLOPs against hand-counted GEMMs and attention, seconds as the larger of
compute and memory time, views and metadata free, the same on fake and real tensors, and kept
matmuls never recounted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import actplan
from actplan.measure import ACCELERATORS, FakeRun, RooflineClock, accelerator
from actplan.models import load_model, train_step


def test_matrix_product_flops_and_seconds_are_the_hand_counted_ones():
    m, k, n = 64, 128, 32
    a, b = torch.randn(m, k), torch.randn(k, n)
    clock = RooflineClock("h100")
    with clock:
        a @ b
    assert clock.flops == 2 * m * k * n
    assert clock.bytes_moved == (m * k + k * n + m * n) * 4
    h100 = accelerator("h100")
    expected = max(2 * m * k * n / h100.fp32_flops, (m * k + k * n + m * n) * 4 / h100.hbm_bytes_per_s)
    assert clock.seconds == pytest.approx(expected)


def test_a_linear_layer_trained_once_costs_six_mkn_flops():
    m, k, n = 16, 48, 24
    x = torch.randn(m, k, requires_grad=True)
    layer = torch.nn.Linear(k, n, bias=False)
    clock = RooflineClock("a100")
    with clock:
        layer(x).sum().backward()
    # Forward x @ W^T; backward grad @ W (input) and grad^T @ x (weight).
    assert clock.flops == 6 * m * k * n


def test_bf16_products_run_at_the_bf16_peak():
    a, b = torch.randn(256, 256, dtype=torch.bfloat16), torch.randn(256, 256, dtype=torch.bfloat16)
    clock = RooflineClock("h200")
    with clock:
        a @ b
    h200 = ACCELERATORS["h200"]
    expected = max(2 * 256**3 / h200.bf16_flops, 3 * 256 * 256 * 2 / h200.hbm_bytes_per_s)
    assert clock.seconds == pytest.approx(expected)


def test_cpu_flash_attention_is_counted_as_the_gpu_kernel_would_be():
    b, h, s, d = 2, 4, 64, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    clock = RooflineClock("h100")
    with clock:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # Q K^T and P V, each 2 b h s s d (causal masking is not discounted, as torch's counter does).
    assert clock.flops == 4 * b * h * s * s * d


def test_grouped_query_attention_is_counted_with_key_value_heads_broadcast():
    # torch < 2.13's formulas refuse fewer key/value heads than query heads; the kernels
    # broadcast them, so the count is that of full-headed attention (forward and backward).
    from actplan.measure._roofline import op_flops

    b, h, kv_heads, s, d = 2, 4, 2, 32, 16
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, requires_grad=True) for _ in range(2))
    clock = RooflineClock("h100")
    with clock:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    by_op = {name.split(".")[-1]: cost.flops for name, cost in clock.by_op.items()}
    full = 4 * b * h * s * s * d
    assert by_op["_scaled_dot_product_flash_attention_for_cpu"] == full
    assert by_op["_scaled_dot_product_flash_attention_for_cpu_backward"] == 2.5 * full
    # The GPU kernels' formulas (torch's own) are given the broadcast shapes too.
    meta_q = torch.empty(b, h, s, d, device="meta")
    meta_kv = torch.empty(b, kv_heads, s, d, device="meta")
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert op_flops(efficient, (meta_q, meta_kv, meta_kv, None, False), {}, None) == full


def test_views_and_metadata_cost_nothing():
    x = torch.randn(8, 16)
    clock = RooflineClock("h100")
    with clock:
        x.view(16, 8).t()[::2].unsqueeze(0)
        x.reshape(128).expand(2, 128)
        x.size(0)
    assert clock.seconds == 0 and clock.bytes_moved == 0 and not clock.by_op


def test_allocating_without_writing_costs_nothing():
    # No kernel runs for an empty tensor (FSDP's all-gather outputs, offload's reload targets);
    # a zeroed one is written.
    x = torch.randn(8, 16)
    clock = RooflineClock("h100")
    with clock:
        torch.empty(1024)
        torch.empty_strided((4, 4), (1, 4))
        torch.empty_like(x)
        x.new_empty(64)
    assert clock.seconds == 0 and clock.bytes_moved == 0 and not clock.by_op
    with clock:
        torch.zeros(1024)
    assert clock.bytes_moved == 4096


def test_unknown_accelerator_lists_the_table():
    with pytest.raises(ValueError, match="unknown accelerator 'v100'; known: a100, h100, h200, b200, mi300x"):
        RooflineClock("v100")
    assert all(accel.source for accel in ACCELERATORS.values())


def _clocked(preset: str, fake: bool) -> RooflineClock:
    clock = RooflineClock("h100")
    with FakeRun() if fake else torch.device("cpu"):
        bundle = load_model("dense", "tiny")
        if preset != "none":
            actplan.apply(bundle.model, preset)
        with clock:
            train_step(bundle.model, bundle.batch(0, torch.device("cpu")), seed=0)
    return clock


def test_fake_and_real_steps_cost_the_same_and_kept_matmuls_are_not_recounted():
    clocks = {(p, fake): _clocked(p, fake) for p in ("none", "matmuls", "full") for fake in (False, True)}
    for preset in ("none", "matmuls", "full"):
        real, fake = clocks[preset, False], clocks[preset, True]
        assert (fake.flops, fake.bytes_moved) == (real.flops, real.bytes_moved), preset
    # Keeping every matmul recomputes no FLOP; recomputing the whole layer repeats its forward.
    assert clocks["matmuls", True].flops == clocks["none", True].flops
    assert clocks["full", True].flops > clocks["none", True].flops
    assert clocks["full", True].seconds > clocks["matmuls", True].seconds > clocks["none", True].seconds


def test_a_profile_on_the_roofline_clock_never_keeps_a_unit_that_runs_no_op():
    """A MoE shape without a shared expert still declares the unit; it runs no op, so no
    candidate keeps it (the engine would warn that keeping it saves nothing)."""
    import warnings

    from actplan.measure import FakeRun
    from actplan.models import build_model
    from actplan.planning.profile import profile_model

    stages = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran no op.*")
        with FakeRun() as fake:
            bundle = build_model("moe", "tiny", shared_expert_ffn_dim=0)
            profile = profile_model(
                bundle, spec="moe", device=fake.device, gpu="h100", progress=lambda e: stages.append(e.stage)
            )
    moe = next(t for t in profile.layer_types if t.class_name == "MoEDecoderLayer")
    kept = {unit for c in moe.candidates for unit in c.kept_units}
    assert "shared_experts" not in kept and {"moe_experts", "attn_core"} <= kept
    assert any("shared_experts runs no op here" in stage for stage in stages)
    assert all(c.extra_seconds >= 0 for c in moe.candidates) and profile.roofline_gpu == "h100"
