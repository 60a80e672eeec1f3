"""``actplan estimate``: the fake-tensor step measures what the same step measures on real
tensors, the static memory follows its stated formula, shipped shapes load, and bad input gets
one line naming the problem."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import warnings
from dataclasses import asdict, replace

import pytest
import torch

from actplan.cli import main
from actplan.config import RecomputeConfig
from actplan.measure import AllocatorSettings, accelerator
from actplan.models.shape import Shape, load_shape, shape_from_hf_config, shape_names
from actplan.planning._estimate_plans import shallow_profile
from actplan.planning._rank_step import rank_step
from actplan.planning._workers import WORKERS_ENV, Workers, default_workers, usable_cores
from actplan.planning.estimate import FRONTIER_KINDS, TrainingSetup, estimate, preset_step

SMALL = Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=2, dtype="fp32")
SMALL_MOE = Shape(
    model="moe", layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=16, batch=2, dtype="fp32",
    experts=4, top_k=2, expert_ffn=64, shared_ffn=32, first_k_dense=1,
)  # fmt: skip


@pytest.mark.parametrize("preset", ["none", "full", "matmuls"])
def test_the_fake_step_measures_what_the_real_step_measures(preset):
    fake, sizes = preset_step(SMALL, preset, "h100", fake=True)
    real, real_sizes = preset_step(SMALL, preset, "h100", fake=False)
    assert (fake.activation_bytes, fake.step_peak_bytes) == (real.activation_bytes, real.step_peak_bytes)
    assert (fake.flops, sizes) == (real.flops, real_sizes)
    assert fake.activation_bytes > 0 and fake.flops > 0


@pytest.mark.parametrize(
    ("shape", "tp", "ep"),
    [(SMALL, 2, 1), (SMALL_MOE, 2, 2), (replace(SMALL, head_dim=24), 1, 1)],
    ids=["dense-tp2", "moe-tp2-ep2", "head-dim-apart"],
)
def test_one_ranks_shape_measures_on_fake_tensors_what_it_measures_on_real_ones(shape, tp, ep):
    rank = shape.per_rank(tp, ep)
    fake, sizes = preset_step(rank, "matmuls", "h100", fake=True)
    real, real_sizes = preset_step(rank, "matmuls", "h100", fake=False)
    assert (fake.activation_bytes, fake.step_peak_bytes, fake.flops) == (
        real.activation_bytes,
        real.step_peak_bytes,
        real.flops,
    )
    assert sizes == real_sizes
    if tp == ep == 1:  # heads of 24 on hidden 64: wider attention than SMALL's 4 x 16
        narrow, _ = preset_step(SMALL, "matmuls", "h100")
        assert fake.flops > narrow.flops and fake.activation_bytes > narrow.activation_bytes
        return
    whole, whole_sizes = preset_step(shape, "matmuls", "h100")
    # Heads, FFN and vocabulary split tp ways, experts ep ways: less of everything per rank.
    assert whole.flops > fake.flops and whole.activation_bytes > fake.activation_bytes
    assert whole_sizes.parameters > sizes.parameters
    if ep > 1:
        assert sizes.expert_parameters * ep == whole_sizes.expert_parameters


def _untimed(ran):
    """A rank step's figures without the roofline clock's times (its bytes and FLOPs kept)."""
    return replace(ran, seconds=0.0, exposed_comm_seconds=0.0)


def test_a_layout_that_does_not_divide_is_named():
    with pytest.raises(ValueError, match=r"--tp 3 must divide heads \(4\), kv_heads \(2\)"):
        SMALL.per_rank(tp=3)
    with pytest.raises(ValueError, match=r"--ep 3 must divide experts \(4\)"):
        SMALL_MOE.per_rank(ep=3)
    with pytest.raises(ValueError, match="needs a MoE shape"):
        SMALL.per_rank(ep=2)
    with pytest.raises(ValueError, match="--ep 4 must divide the 2 ranks of --fsdp 2"):
        estimate(SMALL_MOE, ("none",), fsdp=2, ep=4)
    with pytest.raises(ValueError, match=r"--ep 4 must divide the 6 ranks of --fsdp 3 x --tp 2"):
        estimate(SMALL_MOE, ("none",), fsdp=3, tp=2, ep=4)


def test_the_fake_profile_sees_every_byte_and_second_the_real_profile_sees():
    """Profiled on the roofline clock, fake and real runs give the same candidates, bytes and
    (clocked) seconds: nothing in the profile depends on values."""
    from actplan.measure import FakeRun
    from actplan.models import build_model
    from actplan.planning.profile import profile_model

    def profile(fake: bool):
        with contextlib.ExitStack() as stack:
            if fake:
                stack.enter_context(FakeRun())
            bundle = build_model("dense", "small", **SMALL.model_overrides())
            return profile_model(
                bundle,
                spec="dense",
                device=torch.device("cpu"),
                gpu="h100",
                min_bytes=0,  # small tensors: every offloaded candidate moves bytes
                progress=lambda e: None,
            )

    fake, real = profile(True), profile(False)
    assert fake.roofline_gpu == real.roofline_gpu == "h100"
    same = ("param_bytes", "optimizer_bytes", "nonlayer_activation_bytes", "none_peak_bytes")
    same += ("full_peak_bytes", "backward_extra_bytes", "head_transient_bytes", "base_seconds")
    for name in same:
        assert getattr(fake, name) == pytest.approx(getattr(real, name), rel=1e-12), name
    # Offloaded candidates too: the engine moves fake tensors as it moves real ones.
    real_candidates = {c.name: c for t in real.layer_types for c in t.candidates}
    fake_candidates = {c.name: c for t in fake.layer_types for c in t.candidates}
    assert set(fake_candidates) == set(real_candidates)
    assert any(c.offload and c.offloaded_bytes > 0 for c in fake_candidates.values())
    for name, c in fake_candidates.items():
        r = real_candidates[name]
        bytes_ = ("retained_bytes", "transient_bytes", "offloaded_bytes")
        assert [getattr(c, b) for b in bytes_] == [getattr(r, b) for b in bytes_], name
        assert c.extra_seconds == pytest.approx(r.extra_seconds, rel=1e-9), name


# Large enough that activations, not the allocator's 2 MiB and 20 MiB segments, set the peaks.
MEDIUM = Shape(layers=4, hidden=512, heads=8, kv_heads=4, ffn=2048, vocab=4096, seq=2048, batch=2)


def test_plans_are_profiled_planned_and_stepped_on_fake_tensors():
    # Under tensor parallelism the profile splits its shallow stack over a fake TP group as the
    # rows' rank step does: sequence-parallel regions at s/tp, the TP collectives on the clock
    # and rerun by a recomputed layer. Profiled bare at one rank's width instead, these plans
    # came out 17%, 8% and 2% above their predicted peaks, and up to 0.035 slower.
    result = estimate(MEDIUM, ("none", "full"), fsdp=2, tp=2, plans=True)
    none, full, *plans = result.rows
    assert len(plans) == 3 and plans == result.plans
    for plan in plans:
        # Each plan fits its budget as stepped, and the planner predicted its peak closely.
        assert plan.fits, plan
        assert full.peak_bytes <= plan.peak_bytes <= none.peak_bytes
        assert plan.predicted_peak_bytes == pytest.approx(plan.peak_bytes, rel=0.05)
        assert plan.predicted_ratio == pytest.approx(plan.ratio_to_none, abs=0.03)
        config = RecomputeConfig.from_yaml(plan.plan_yaml)
        assert config.to_yaml() == plan.plan_yaml
    assert plans[0].budget_bytes < plans[1].budget_bytes < plans[2].budget_bytes
    assert plans[0].seconds >= plans[2].seconds


def test_the_moe_reference_model_under_tensor_parallelism_is_stepped_with_its_loss_parallel():
    # Its head's loss is a DTensor under loss parallelism, its router's balance loss a plain
    # tensor: the model adds them as the whole loss every rank holds.
    none, full = estimate(SMALL_MOE, ("none", "full"), fsdp=2, tp=2).rows
    assert full.activation_bytes < none.activation_bytes and full.seconds > none.seconds


def test_experts_over_every_fsdp_rank_run_the_real_path_with_the_users_training_setup():
    # --ep equal to --fsdp is what actplan.parallelize runs: measured, not a formula, so the
    # training setup applies; each rank's experts stay whole (left out of FSDP).
    frozen = TrainingSetup(freeze=r"\.experts\.")
    result = estimate(SMALL_MOE, ("none", "full"), fsdp=2, ep=2)
    lean = estimate(SMALL_MOE, ("none",), fsdp=2, ep=2, training=frozen)
    assert "experts over 2 of them (left out of FSDP)" in result.method and "formula" not in result.method
    none, full = result.rows
    assert full.activation_bytes < none.activation_bytes
    # 2 MoE layers of 2 local experts (gate, up, down: 64 x 64 each) in fp32; frozen, they hold
    # no AdamW moments (8 bytes each) and no step count (a 4-byte tensor per parameter tensor),
    # and nothing else changes between steps.
    local_expert_params = 2 * 2 * 3 * 64 * 64
    assert result.static_bytes - lean.static_bytes == 8 * local_expert_params + 4 * 2 * 3
    assert result.parameters == lean.parameters  # this rank's model: its own experts only


def test_experts_over_part_of_the_fsdp_ranks_run_the_real_path_and_hold_their_share():
    # Experts over 2 of 4 ranks, each FSDP-sharded over the 2 that hold it inside its layer:
    # measured. A rank then holds a quarter of every expert's state, as with experts over all 4
    # ranks (left out of FSDP) or none (sharded with the rest): the same static bytes.
    result = estimate(SMALL_MOE, ("none", "full"), fsdp=4, ep=2)
    assert "experts over 2 of them (each FSDP-sharded over 2)" in result.method
    assert "formula" not in result.method
    none, full = result.rows
    assert full.activation_bytes < none.activation_bytes
    for ep in (1, 4):
        assert estimate(SMALL_MOE, ("none",), fsdp=4, ep=ep).static_bytes == result.static_bytes


@pytest.mark.parametrize("ep", [2, 4])
def test_experts_over_ranks_with_tensor_parallelism_run_the_real_path(ep):
    # FSDP 2 x TP 2 with sequence parallelism, each rank routing its own sequence shard, the
    # experts over 2 of the 4 ranks (FSDP-sharded over the other 2) or over all 4: measured,
    # with plans profiled on one rank split both ways (once: the profile is the slow part). (Its
    # bytes against real gloo ranks: test_estimate_gloo.py.)
    result = estimate(SMALL_MOE, ("none", "full"), fsdp=2, tp=2, ep=ep, plans=ep == 2)
    held = "(each FSDP-sharded over 2)" if ep == 2 else "(left out of FSDP)"
    assert f"FSDP2 over 2 x TP 2 with sequence parallelism, experts over {ep} of them {held}" in result.method
    none, full = result.rows[:2]
    assert full.activation_bytes < none.activation_bytes and bool(result.plans) == (ep == 2)
    # A rank holds its share of the sequence: less than with the same experts over FSDP alone.
    alone = estimate(SMALL_MOE, ("none",), fsdp=4, ep=ep).rows[0]
    assert none.activation_bytes < alone.activation_bytes


def test_an_expert_parallel_profile_holds_what_a_rank_exchanges():
    # Profiled over 2 fake EP ranks, a fully checkpointed MoE layer holds its all-to-alls'
    # outputs (the replay never re-communicates): the dispatched and returned rows (32 tokens x
    # top 2 x hidden 64, fp32) and the received counts (4 experts, int64); and the sort that
    # orders the arrived rows by expert (its keys and indices, 64 of each, int64), a routing
    # decision. Profiled bare at one rank's share (what the estimate did before), it held none of
    # them, and the planner predicted its plans' peaks up to 8% low on a MoE shape at FSDP 4 x EP 4.
    def full(profile):
        layer = next(t for t in profile.layer_types if t.class_name == "MoEDecoderLayer")
        return layer.candidate("full").retained_bytes

    split = shallow_profile(SMALL_MOE, "h100", ep=2)
    bare = shallow_profile(SMALL_MOE.per_rank(1, 2), "h100")
    assert full(split) - full(bare) == 2 * 32 * 2 * 64 * 4 + 4 * 8 + 2 * 64 * 8


def test_static_memory_follows_the_stated_formula_and_the_budget_picks_the_fastest_fit():
    # Expert parallel with TP on latent attention, which the reference model's tensor
    # parallelism does not split, runs the rank's layers bare, with the static memory by formula.
    presets = ("none", "full", "matmuls")
    result = estimate(SMALL_MLA_MOE, presets, gpu="a100", fsdp=4, tp=2, ep=2, budget_bytes=70 * 2**30)
    dense = result.parameters - preset_step(SMALL_MLA_MOE.per_rank(2, 2), "none", "a100")[1].expert_parameters
    # The rank's experts live on the 4 x 2 / 2 ranks that hold the same ones.
    assert result.static_bytes == 16 * dense // 4 + 16 * (result.parameters - dense) // 4
    none, full, matmuls = result.rows
    for row in result.rows:
        assert row.peak_bytes == result.static_bytes + result.gathered_bytes + row.step_peak_bytes
        assert row.peak_bytes <= row.allocated_peak_bytes <= row.reserved_peak_bytes
        assert row.fits
    assert none.ratio_to_none == 1.0 and full.ratio_to_none > matmuls.ratio_to_none >= 1.0
    assert full.activation_bytes < matmuls.activation_bytes < none.activation_bytes
    assert result.recommended.preset == "none"  # everything fits: the fastest
    assert "formula" in result.method
    assert any("does not split multi-head latent attention" in note for note in result.notes)


def test_sequence_parallel_regions_are_held_at_a_ranks_share_of_the_sequence():
    # Under TP with sequence parallelism a fully checkpointed layer holds its input at s/tp:
    # one more layer adds seq * batch * hidden * 4 bytes (fp32 here) / tp to the forward's end.
    shape = replace(MEDIUM, layers=2, dtype="fp32")
    added = {
        tp: rank_step(replace(shape, layers=3), "full", 2, "h100", tp=tp).activation_bytes
        - rank_step(shape, "full", 2, "h100", tp=tp).activation_bytes
        for tp in (1, 2, 4)
    }
    whole = shape.seq * shape.batch * shape.hidden * 4
    assert added == {1: whole, 2: whole // 2, 4: whole // 4}


def test_fits_means_reserved_and_what_sits_outside_the_allocator_within_the_budget():
    result = estimate(MEDIUM, ("none", "full"), fsdp=4)
    _, full = result.rows
    assert "fake process group" in result.method
    for row in result.rows:
        assert row.peak_bytes <= row.allocated_peak_bytes <= row.reserved_peak_bytes
        assert row.outside_allocator_bytes >= 500 * 2**20  # the CUDA context at least
        assert row.fits  # against the GPU's memory, with no budget
    held = full.reserved_peak_bytes + full.outside_allocator_bytes
    tight = estimate(MEDIUM, ("none", "full"), fsdp=4, budget_bytes=held)
    assert [r.fits for r in tight.rows] == [False, True] and tight.recommended.preset == "full"
    under = estimate(MEDIUM, ("full",), fsdp=4, budget_bytes=held - 1)
    assert under.rows[0].fits is False


def test_a_budget_above_the_gpus_memory_is_refused_with_both_figures():
    with pytest.raises(ValueError, match=r"931\.323 GiB is more than the h100's 74\.506 GiB"):
        estimate(SMALL, ("none",), budget_bytes=10**12)


def test_allocator_settings_change_what_is_reserved_not_what_is_allocated(monkeypatch, capsys):
    plain = estimate(MEDIUM, ("none",), fsdp=2).rows[0]
    expandable = estimate(
        MEDIUM, ("none",), fsdp=2, allocator=AllocatorSettings.parse("expandable_segments:True")
    ).rows[0]
    assert expandable.allocated_peak_bytes == plain.allocated_peak_bytes
    assert expandable.reserved_peak_bytes < plain.reserved_peak_bytes
    # The command line reads PYTORCH_ALLOC_CONF, and names the known keys for an unknown one.
    args = ["estimate", "--model", "dense", "--layers", "2", "--hidden", "64", "--heads", "4", "--quiet"]
    args += ["--kv-heads", "2", "--ffn", "128", "--vocab", "128", "--seq", "32", "--presets", "none"]
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert main(args) == 0
    assert "allocator: expandable_segments:True" in " ".join(capsys.readouterr().out.split())
    assert main([*args, "--alloc-conf", "max_split:64"]) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert "unknown allocator setting 'max_split'; known: max_split_size_mb" in printed


def test_adamw_runs_as_the_implementation_named():
    # foreach AdamW allocates temporaries the size of the parameter shards at the optimizer
    # step, fused none: the same state between steps, never more at the peak.
    foreach = rank_step(SMALL, "full", 2, "h100")
    fused = rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(optimizer_impl="fused"))
    assert fused.resident_bytes == foreach.resident_bytes
    assert fused.peak_bytes <= foreach.peak_bytes
    with pytest.raises(ValueError, match="unknown optimizer implementation 'lion'; choose one of foreach"):
        rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(optimizer_impl="lion"))


def _fp32_shard_bytes(names_match=lambda name: True, fsdp=2):
    from actplan.models import build_model

    model = build_model(SMALL.model, "small", **SMALL.model_overrides()).model
    chosen = [p for name, p in model.named_parameters() if names_match(name)]
    assert all(p.shape[0] % fsdp == 0 for p in chosen)  # FSDP2 pads no shard at this shape
    return sum(p.numel() for p in chosen) * 4 // fsdp, len(chosen)


def test_the_optimizer_named_holds_the_state_its_step_allocates():
    # AdamW holds two fp32 moments per parameter shard and a 4-byte step count per tensor;
    # SGD without momentum holds nothing between steps.
    adamw = rank_step(SMALL, "full", 2, "h100")
    sgd = rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(optimizer="SGD"))
    by_path = rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(optimizer="torch.optim.SGD"))
    shard_bytes, tensors = _fp32_shard_bytes()
    assert adamw.resident_bytes - sgd.resident_bytes == 2 * shard_bytes + 4 * tensors
    assert _untimed(by_path) == _untimed(sgd)


def test_frozen_parameters_hold_no_gradient_and_no_optimizer_state():
    frozen = rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(freeze=r"^embed\."))
    trained = rank_step(SMALL, "full", 2, "h100")
    shard_bytes, tensors = _fp32_shard_bytes(lambda name: name.startswith("embed."))
    assert tensors == 1
    assert trained.resident_bytes - frozen.resident_bytes == 2 * shard_bytes + 4 * tensors
    assert frozen.step_peak_bytes < trained.step_peak_bytes  # and no gradient while stepping
    with pytest.raises(ValueError, match=r"finds no parameter; names look like: embed\.weight"):
        rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(freeze="lora_"))
    with pytest.raises(ValueError, match="finds every parameter; nothing would train"):
        rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(freeze="."))


def test_accumulated_micro_batches_keep_the_sharded_gradients_between_them():
    one = rank_step(SMALL, "full", 2, "h100")
    two = rank_step(SMALL, "full", 2, "h100", training=TrainingSetup(grad_accum=2))
    assert two.resident_bytes == one.resident_bytes
    assert two.activation_bytes == one.activation_bytes  # each micro-batch's own
    assert two.step_peak_bytes > one.step_peak_bytes  # the 2nd starts with the 1st's gradients

    # Two micro-batches' work, and the 2nd's gradients added to the sharded ones (the 1st's
    # last reduce-scatters hide behind the 2nd's compute: compared without communication).
    def compute(ran):
        return ran.seconds - ran.exposed_comm_seconds

    assert 2 * compute(one) < compute(two) < 2.5 * compute(one)
    assert two.exposed_comm_seconds < 2 * one.exposed_comm_seconds


def test_moe_estimate_routes_tokens_evenly():
    result = estimate(SMALL_MOE, ("none", "matmuls"))
    assert all(row.activation_bytes > 0 for row in result.rows)


def test_shipped_shapes_load_and_say_where_they_come_from():
    from importlib import resources

    assert {"llama3-8b", "llama3-70b", "mixtral-8x7b"} <= set(shape_names())
    for name in shape_names():
        shape = load_shape(name, seq=4096)
        assert shape.seq == 4096 and shape.name == name
        text = (resources.files("actplan.models") / "shapes" / f"{name}.yaml").read_text()
        assert "Source:" in text
    assert load_shape("llama3-70b").layers == 80


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "llama-9b"], "unknown shape 'llama-9b'; known shapes: deepseek-v3, llama3-70b"),
        (["--shape", "llama3-8b", "--heads", "30"], "heads (30) must divide hidden (4096)"),
        (["--shape", "llama3-8b", "--kv-heads", "5"], "kv_heads (5) must divide heads (32)"),
        (["--shape", "llama3-8b", "--experts", "8"], "apply to model 'moe' only"),
        (["--shape", "mixtral-8x7b", "--top-k", "9"], "top_k (9) must be between 1 and experts (8)"),
        (["--model", "moe", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
          "--ffn", "64", "--vocab", "64"], "model 'moe' needs experts, top_k, expert_ffn"),
        (["--model", "dense", "--layers", "2"], "--model dense needs --hidden"),
        ([], "give --shape NAME"),
        (["--shape", "llama3-8b", "--model", "dense"], "not several"),
        (["--shape", "llama3-8b", "--fsdp", "0"], "fsdp must be 1 or more"),
        (["--shape", "llama3-8b", "--tp", "3"], "--tp 3 must divide heads (32), kv_heads (8)"),
        (["--shape", "llama3-8b", "--ep", "2"], "--ep 2 needs a MoE shape"),
        (["--shape", "llama3-8b", "--out", "plan.yaml"], "--out writes the plan for --budget"),
        (["--shape", "llama3-8b", "--hf-config", "x.json"], "give one of --shape, --hf-config"),
        (["--hf-config", "/nonexistent/config.json"], "no such file; give a local config.json"),
        (["--shape", "llama3-8b", "--budget", "80"], "under 1 MiB; write it with a unit"),
        (["--shape", "llama3-8b", "--presets", "full,fulll"], "'fulll' is neither a preset name nor an "
         "existing config file; valid presets: none, full"),
        (["--shape", "llama3-8b", "--presets", "fulll"], "what users run today: torch-checkpoint, "
         "titan-op-sac, titan-layer-sac:N"),
        (["--shape", "llama3-8b", "--presets", "titan-layer-sac:0"], "a whole number of 1 or more"),
        (["--shape", "llama3-8b", "--optimizer", "Lion"], "torch.optim has no 'Lion'; name a torch.optim "
         "class (ASGD, Adadelta"),
        (["--shape", "llama3-8b", "--optimizer", "json.JSONDecoder"], "'json.JSONDecoder' is not a "
         "torch.optim.Optimizer"),
        (["--shape", "llama3-8b", "--optimizer", "LBFGS", "--optimizer-impl", "fused"], "LBFGS takes no "
         "such flag"),
        (["--shape", "llama3-8b", "--grad-accum", "0"], "--grad-accum must be 1 or more"),
        (["--shape", "llama3-8b", "--freeze", "("], "--freeze '(' is not a regular expression"),
        (["--shape", "deepseek-v3", "--fsdp", "4", "--tp", "2", "--ep", "2", "--grad-accum", "2"],
         "need the measured path, which this expert-parallel layout does not run on"),
        (["--shape", "llama3-8b", "--titan", "llama3:8B"], "give one of --shape, --titan, not several"),
        (["--titan", "llama3:8B", "--heads", "16"], "--heads would change torchtitan's model"),
        (["--titan", "llama3:8B", "--fsdp", "8", "--ep", "2"], "--ep 2 needs a MoE shape; llama3:8B is"),
        (["--shape", "llama3-8b", "--workers", "0"], "--workers must be 1 or more processes, got 0"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_problem(argv, message, capsys):
    assert main(["estimate", "--quiet", *argv]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert message in out, out


@pytest.mark.slow
def test_worker_processes_give_the_rows_and_plans_one_process_gives():
    presets = ("full", "matmuls")  # `none` is stepped for the planner all the same
    lines: list[str] = []
    here = estimate(SMALL, presets, fsdp=2, plans=True, progress=lines.append)
    there = estimate(SMALL, presets, fsdp=2, plans=True, workers=2)
    assert len(here.plans) == 3 and [row.preset for row in here.rows[:2]] == list(presets)
    # The presets' gaps between reserved and predicted bytes, held back, make each first plan fit.
    assert sum(line.startswith("stepping the plan for") for line in lines) == 3, lines
    assert [asdict(row) for row in there.rows] == [asdict(row) for row in here.rows]
    same = (here.parameters, here.static_bytes, here.notes)
    assert (there.parameters, there.static_bytes, there.notes) == same


@pytest.mark.parametrize("count", [1, 2])
def test_workers_return_results_in_order_and_raise_a_workers_error(count):
    finished = []
    with Workers(count) as workers:
        assert workers.parallel == (count > 1)
        assert workers.run([(pow, (2, n), {}) for n in range(5)], finished.append) == [2**n for n in range(5)]
        assert sorted(finished) == list(range(5))
        assert workers.submit(divmod, 7, 2).result() == (3, 1)
        with pytest.raises(ValueError, match="invalid literal for int"):
            workers.run([(pow, (2, 3), {}), (int, ("eight",), {})])


def _warns_and_returns(value: int) -> int:
    warnings.warn(f"worker warning {value}", UserWarning, stacklevel=1)
    return value


def test_a_workers_warnings_are_warned_here_at_the_callers_line():
    # A worker process's warning would print at the pool's own line, in the worker; it is
    # warned again where its result is taken, at the line that asked for it.
    with Workers(2) as workers, pytest.warns(UserWarning, match="worker warning 3") as caught:
        assert workers.run([(_warns_and_returns, (3,), {})]) == [3]
    assert [w.filename for w in caught] == [__file__]


def test_the_default_workers_come_from_the_environment_or_the_cores(monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert default_workers() == 3
    monkeypatch.delenv(WORKERS_ENV)
    assert default_workers() == usable_cores() >= 1
    monkeypatch.setenv(WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="ACTPLAN_WORKERS='many' must be a whole number of processes"):
        default_workers()


def test_unknown_gpu_lists_the_table(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--shape", "llama3-8b", "--gpu", "v100"])
    error = capsys.readouterr().err
    assert "invalid choice: 'v100' (choose from 'a100', 'b200', 'h100', 'h200', 'mi300x')" in error


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    args = ["estimate", "--model", "dense", "--layers", "2", "--hidden", "64", "--heads", "4"]
    args += ["--kv-heads", "2", "--ffn", "128", "--vocab", "128", "--seq", "32", "--batch", "2"]
    assert main([*args, "--presets", "none,full", "--budget", "1GiB", "--json", str(out), "--quiet"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "Estimated on fake tensors" in printed and "times are estimates" in printed
    assert "fastest under 1GiB: none" in printed
    assert re.search(r"FSDP over 1: 0\.\d\d M parameters", printed)  # a test shape's count, not 0.00 B
    data = json.loads(out.read_text())
    assert [row["preset"] for row in data["rows"]] == ["none", "full"]


def test_offload_presets_are_stepped_with_their_host_tier_and_copy_time(tmp_path, capsys):
    # The offload engine runs on the fake tensors: a row that offloads holds fewer device bytes
    # at the end of forward than its preset alone, names the host tier it needs, and pays the
    # copies its compute cannot hide.
    out = tmp_path / "estimate.json"
    shape = ["--model", "dense", "--layers", "4", "--hidden", "512", "--heads", "8", "--kv-heads", "4"]
    shape += ["--ffn", "2048", "--vocab", "4096", "--seq", "2048", "--batch", "2", "--fsdp", "2"]
    assert main(["estimate", *shape, "--presets", "full,full+offload", "--json", str(out), "--quiet"]) == 0
    assert "host: pinned host memory" in " ".join(capsys.readouterr().out.split())
    full, offloaded = json.loads(out.read_text())["rows"]
    assert full["moved"] is None
    moved = offloaded["moved"]
    layer_input = 2 * 2048 * 512 * 2  # one bf16 layer input; the last layer's stays resident
    assert moved["offloaded_bytes"] == moved["reloaded_bytes"] == 3 * layer_input
    assert moved["host_bytes"] >= moved["offloaded_bytes"]
    assert offloaded["activation_bytes"] == full["activation_bytes"] - 3 * layer_input
    # Each reload is asked for a layer ahead of its use and hides behind that layer's backward,
    # except the first one backward meets: asked for where it is used, at the host link.
    on_demand = layer_input / accelerator("h100").host_link_bytes_per_s
    assert moved["exposed_seconds"] == pytest.approx(on_demand)
    assert offloaded["seconds"] == pytest.approx(full["seconds"] + on_demand)
    assert main(["estimate", *shape, "--presets", "full+offlaod", "--quiet"]) == 2
    printed = capsys.readouterr()
    assert "a preset with offload: full+offload, matmuls+offload" in printed.out + printed.err


def test_a_host_budget_bounds_the_plans_and_the_links_can_be_named(tmp_path, capsys):
    # 16 MiB per node for this job's 2 GPUs: 8 MiB each, below full+offload's three 4 MiB layer
    # inputs; the frontier's offload plans keep within it. PCIe 4 halves the host link.
    shape = ["--model", "dense", "--layers", "4", "--hidden", "512", "--heads", "8", "--kv-heads", "4"]
    shape += ["--ffn", "2048", "--vocab", "4096", "--seq", "2048", "--batch", "2", "--fsdp", "2"]
    out = tmp_path / "estimate.json"
    args = ["--presets", "full+offload", "--host-budget", "16MiB", "--host-link", "pcie4", "--frontier"]
    assert main(["estimate", *shape, *args, "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "does not fit the host: full+offload pins" in printed and "raise --host-budget" in printed
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert not row["fits"] and row["moved"]["host_bytes"] > 8 * 2**20
    layer_input = 2 * 2048 * 512 * 2
    assert row["moved"]["exposed_seconds"] == pytest.approx(layer_input / 32e9)  # PCIe 4 x16
    offload = data["frontiers"][FRONTIER_KINDS[1]]
    assert any(p["host_bytes"] > 0 for p in offload)
    assert all(p["host_bytes"] <= 8 * 2**20 for p in offload)
    assert main(["estimate", *shape, "--network", "nvlink9", "--quiet"]) == 2
    assert "unknown --network 'nvlink9'; known: pcie4 (32 GB/s)" in capsys.readouterr().out
    assert main(["estimate", *shape, "--host-budget", "3TiB", "--quiet"]) == 2
    assert "--host-budget 3072.000 GiB is outside what a node holds: give 0 up to its host memory, 2 TB" in (
        capsys.readouterr().out
    )


def test_a_plan_pinning_more_than_the_default_pool_raises_its_cap():
    from actplan.planning.choose import host_cap_for
    from actplan.sizes import DEFAULT_HOST_CAP_BYTES

    assert host_cap_for(0) is None and host_cap_for(DEFAULT_HOST_CAP_BYTES * 0.8) is None
    assert host_cap_for(42 * 2**30) == 48 * 2**30  # 42 GiB and an eighth, in whole GiB
    offload = {"layers": "0-1", "layer_input": True, "host_cap": host_cap_for(42 * 2**30)}
    config = RecomputeConfig.from_dict({"mode": "full", "offload": offload})
    assert config.offload.host_cap == 48 * 2**30 and "host_cap: 48GiB" in config.to_yaml()


def test_the_frontier_with_offload_is_never_slower_and_reaches_fewer_activations(tmp_path, capsys):
    plot = tmp_path / "frontier.png"
    shape = ["--model", "dense", "--layers", "4", "--hidden", "512", "--heads", "8", "--kv-heads", "4"]
    shape += ["--ffn", "2048", "--vocab", "4096", "--seq", "2048", "--batch", "2", "--fsdp", "2"]
    out = tmp_path / "estimate.json"
    args = ["--presets", "none", "--frontier", "--plot", str(plot), "--json", str(out)]
    assert main(["estimate", *shape, *args]) == 0
    printed = capsys.readouterr().out
    assert "the planner's frontier" in printed and "at most 1.03x" in printed
    assert plot.stat().st_size > 0
    data = json.loads(out.read_text())
    frontiers = data["frontiers"]
    # Each frontier's plan with the least activations at 1.03x or less is stepped: its step is
    # the check of the prediction the frontier is drawn from.
    checks = [row for row in data["rows"] if row["preset"].startswith("frontier")]
    assert checks and all(row["predicted_ratio"] <= 1.03 for row in checks)
    for row in checks:
        assert row["ratio_to_none"] == pytest.approx(row["predicted_ratio"], abs=0.03)
    keep, offload = (frontiers[kind] for kind in FRONTIER_KINDS)
    for points in (keep, offload):
        # Least peak first, each faster than every plan below it; none's plan at the top.
        assert [p["peak_bytes"] for p in points] == sorted(p["peak_bytes"] for p in points)
        assert all(a["ratio"] > b["ratio"] for a, b in itertools.pairwise(points))
        assert points[-1]["share_of_none"] == pytest.approx(1.0) and points[-1]["ratio"] == pytest.approx(1.0)
    assert all(p["host_bytes"] == 0 for p in keep) and any(p["host_bytes"] > 0 for p in offload)
    assert offload[0]["share_of_none"] < keep[0]["share_of_none"]

    for point in keep:  # offload's candidates only add choices: as fast within the same budget
        within = [p["ratio"] for p in offload if p["peak_bytes"] <= point["budget_bytes"]]
        assert min(within) <= point["ratio"] * (1 + 1e-9)
    assert main(["estimate", *shape, "--presets", "none", "--plot", str(plot)]) == 2
    assert "--plot draws the frontier; give --frontier too" in capsys.readouterr().out


def test_cli_names_torchtitans_code_when_it_measured_it(capsys):
    pytest.importorskip("torchtitan")
    argv = ["estimate", "--titan", "llama3:debugmodel", "--layers", "2", "--seq", "32", "--batch", "2"]
    assert main([*argv, "--fsdp", "2", "--presets", "none", "--quiet"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "code measured: torchtitan's own llama3:debugmodel" in printed


QWEN3_MOE_CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "decoder_sparse_step": 1,
}  # fmt: skip


def test_a_hugging_face_config_maps_onto_the_shape_it_describes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE_CONFIG))
    shape = shape_from_hf_config(tmp_path, seq=4096)  # a folder holding config.json
    expected = replace(load_shape("qwen3-30b-a3b", seq=4096), name="qwen3_moe")
    assert shape == replace(expected, hf_config=str(tmp_path / "config.json"))
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                 "num_attention_heads": 32, "num_key_value_heads": 8,
                                 "intermediate_size": 14336, "vocab_size": 128256}))  # fmt: skip
    assert shape_from_hf_config(llama) == replace(load_shape("llama3-8b"), name="llama", hf_config=str(llama))


def _tiny_hf_config(tmp_path, **fields):
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
              "max_position_embeddings": 64, "tie_word_embeddings": False, **fields}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("fsdp,tp,preset", [(2, 1, "none"), (2, 1, "full"), (1, 2, "matmuls")])
def test_a_hugging_face_config_steps_transformers_own_class_fake_as_real(tmp_path, fsdp, tp, preset):
    # The measured step builds the class the config names (its norms, RoPE, attention and loss
    # code), parallelized as actplan.parallelize does for it, and the fake step measures what
    # the same step measures on real tensors.
    pytest.importorskip("transformers")
    shape = shape_from_hf_config(_tiny_hf_config(tmp_path), seq=32, batch=2, dtype="fp32")
    fake = rank_step(shape, preset, fsdp, "h100", tp=tp)
    real = rank_step(shape, preset, fsdp, "h100", fake=False, tp=tp)
    assert _untimed(fake) == _untimed(real)
    assert fake.activation_bytes > 0


def test_plans_for_a_hugging_face_config_under_tensor_parallelism_are_profiled_bare(tmp_path):
    # A transformers class's layer does not run alone under TP: its profile keeps one rank's
    # share bare (the reference models' is split over the fake TP group), and its plans step.
    pytest.importorskip("transformers")
    shape = shape_from_hf_config(_tiny_hf_config(tmp_path), seq=32, batch=2, dtype="fp32")
    memory = accelerator("h100").memory_bytes  # one budget, one plan
    (plan,) = estimate(shape, ("none",), tp=2, plans=True, budget_bytes=memory).plans
    assert plan.fits and RecomputeConfig.from_yaml(plan.plan_yaml).made_for is not None


def test_tied_embeddings_are_one_parameter_in_the_estimate(tmp_path):
    import transformers

    path = _tiny_hf_config(tmp_path, tie_word_embeddings=True)
    shape = shape_from_hf_config(path, seq=32, batch=2, dtype="fp32")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    tied = sum(p.numel() for p in model.parameters())  # the head shares the embedding's weight
    assert rank_step(shape, "full", 2, "h100").parameters == tied
    untied = shape_from_hf_config(_tiny_hf_config(tmp_path), seq=32, batch=2, dtype="fp32")
    assert rank_step(untied, "full", 2, "h100").parameters == tied + 128 * 64


def test_a_plan_estimated_for_a_hugging_face_config_applies_to_that_model(tmp_path):
    # The plans are profiled on the class itself: their units are its layer's, and their
    # made_for block names its layers, so the plan installs on the user's model, exactly.
    import transformers

    import actplan
    from actplan.measure import capture_step, compare_steps
    from actplan.models import train_step

    path = _tiny_hf_config(tmp_path, num_hidden_layers=4)
    shape = shape_from_hf_config(path, seq=32, batch=2, dtype="fp32")
    result = estimate(shape, ("none",), fsdp=2, plans=True)
    assert "code measured: transformers' own class for" in " ".join(result.notes)
    texts = [row.plan_yaml for row in result.plans]
    plans = [RecomputeConfig.from_yaml(text) for text in texts]
    assert any(plan.mode != "none" for plan in plans)
    config = transformers.AutoConfig.from_pretrained(tmp_path, use_cache=False)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    for plan in plans:
        assert plan.made_for.layers == 4 and dict(plan.made_for.layer_classes) == {"LlamaDecoderLayer": "0-3"}
        assert plan.made_for.layer_input == (2, 32, config.hidden_size)  # checked on the first forward
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        candidate = transformers.AutoModelForCausalLM.from_config(config)
        candidate.load_state_dict(model.state_dict())
        actplan.apply(candidate, plan)
        report = compare_steps(
            capture_step(model, train_step(model, batch, seed=0)),
            capture_step(candidate, train_step(candidate, batch, seed=0)),
        )
        assert report.ok, report


def test_a_number_a_hugging_face_config_cannot_take_is_refused(tmp_path):
    pytest.importorskip("transformers")
    shape = shape_from_hf_config(_tiny_hf_config(tmp_path), seq=32, batch=2, dtype="fp32")
    moe = replace(shape, model="moe", experts=4, top_k=2, expert_ffn=32, shared_ffn=0, first_k_dense=1)
    with pytest.raises(ValueError, match=r"LlamaConfig has no num_local_experts, num_experts_per_tok, "):
        rank_step(moe, "none", 2, "h100")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**QWEN3_MOE_CONFIG, "model_type": "gemma3_text", "sliding_window_pattern": 6},
         "interleaved sliding-window attention"),
        ({"model_type": "t5", "d_model": 512, "num_heads": 8, "vocab_size": 32128,
          "is_encoder_decoder": True},
         "not a decoder actplan can lay out \\(model_type 't5'; missing num_hidden_layers"),
        ({"model_type": "llama", "hidden_size": 64}, "missing num_hidden_layers, num_attention_heads"),
    ],
)  # fmt: skip
def test_a_config_that_is_not_a_decoder_actplan_lays_out_is_refused(tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        shape_from_hf_config(path)


def test_out_writes_the_plan_for_the_budget_with_what_it_was_made_for(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    args = ["estimate", "--model", "dense", "--layers", "2", "--hidden", "64", "--heads", "4", "--quiet"]
    args += [
        "--kv-heads",
        "2",
        "--ffn",
        "128",
        "--vocab",
        "128",
        "--seq",
        "32",
        "--batch",
        "2",
        "--fsdp",
        "2",
    ]
    assert main([*args, "--presets", "none,full", "--budget", "1GiB", "--out", str(plan)]) == 0
    text = plan.read_text()
    assert text.startswith("# actplan estimate plan for custom: dense, 2 layers")
    assert RecomputeConfig.from_yaml(text).mode in ("none", "full", "selective")
    assert "plan @ 1.000 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["none", "full", "matmuls", "titan-op-sac"])
@pytest.mark.parametrize("fsdp,tp", [(4, 1), (2, 2)], ids=["fsdp4", "fsdp2-tp2"])
def test_the_rank_step_on_fake_tensors_measures_what_it_measures_on_real_tensors(preset, fsdp, tp):
    # The same code path (parallelize: FSDP2, and TP with sequence parallelism), over a fake
    # process group, on fake and on real tensors: every byte figure and the allocator's replay
    # agree exactly. (A MoE layer's step differs by routing: real values route unevenly, the
    # fake run assumes balance.)
    fake = rank_step(SMALL, preset, fsdp, "h100", tp=tp)
    real = rank_step(SMALL, preset, fsdp, "h100", fake=False, tp=tp)
    # Named difference: under TP the roofline clock prices a few ops more on real tensors (4 to
    # 7% of these tiny steps' estimated time, FLOPs equal); time is not this test's subject.
    assert _untimed(fake) == _untimed(real)
    if tp == 1:
        assert fake.seconds == pytest.approx(real.seconds, rel=1e-12)
    assert fake.activation_bytes > 0
    assert fake.allocator.peak_reserved_bytes >= fake.allocator.peak_allocated_bytes


def test_the_rank_step_holds_its_shards_and_adamw_state_between_steps():
    # Between steps a rank holds, per parameter, its fp32 shard (dim 0 in chunks of
    # ceil(d0 / world), padded) and AdamW's two moments of the same size, plus the model's
    # buffers. Named difference: AdamW's 4-byte step counters, which live on the host in a CUDA
    # run, are fake CPU tensors here and counted.
    from actplan.models import build_model

    world = 4
    model = build_model("dense", "small", **SMALL.model_overrides()).model
    shards = sum(4 * -(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in model.parameters())
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    counters = 4 * len(list(model.parameters()))
    ran = rank_step(SMALL, "full", world, "h100")
    assert ran.resident_bytes == 3 * shards + buffers + counters


# Multi-head latent attention (DeepSeek-V2/V3) at a tiny size: query/key heads of 12 + 8, value
# heads of 10 (narrower, as DeepSeek-V3's 192 against 128).
MLA = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10}
SMALL_MLA = replace(SMALL, **MLA)
SMALL_MLA_MOE = replace(SMALL_MOE, router="sigmoid", **MLA)


@pytest.mark.parametrize("preset", ["none", "full", "matmuls"])
@pytest.mark.parametrize("shape", [SMALL_MLA, SMALL_MLA_MOE], ids=["mla-dense", "mla-moe"])
def test_latent_attention_measures_on_fake_tensors_what_it_measures_on_real_ones(shape, preset):
    fake, sizes = preset_step(shape, preset, "h100", fake=True)
    real, real_sizes = preset_step(shape, preset, "h100", fake=False)
    assert (fake.activation_bytes, fake.step_peak_bytes) == (real.activation_bytes, real.step_peak_bytes)
    assert (fake.flops, sizes) == (real.flops, real_sizes)
    assert fake.activation_bytes > 0 and fake.flops > 0


def test_latent_attention_runs_the_fused_kernel_and_keeps_what_the_presets_say():
    from actplan.measure import OpCounter
    from actplan.models import build_model

    bundle = build_model("dense", "tiny", **MLA)
    with OpCounter() as counter:
        bundle.model(**bundle.batch(0))
    # Values padded to the query size: the flash kernel, never the math one with its s x s scores.
    assert counter[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default] == 2
    assert counter[torch.ops.aten._softmax.default] == 0
    none, full, matmuls = (preset_step(SMALL_MLA, p, "h100")[0] for p in ("none", "full", "matmuls"))
    assert full.activation_bytes < matmuls.activation_bytes < none.activation_bytes
    assert none.flops == matmuls.flops < full.flops  # matmuls keeps every projection, down and up


@pytest.mark.parametrize("preset", ["full", "attn", "matmuls", "megatron-selective"])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_latent_attention_gradients_are_exact_under_every_preset(model, preset):
    import copy

    import actplan
    from actplan.measure import capture_step, compare_steps
    from actplan.models import build_model, train_step

    def step(m, batch):
        return capture_step(m, train_step(m, batch, seed=7))

    overrides = {**MLA, "router": "sigmoid"} if model == "moe" else MLA
    bundle = build_model(model, "tiny", dropout=0.1, **overrides)
    batch = bundle.batch(0)
    candidate = copy.deepcopy(bundle.model)
    actplan.apply(candidate, preset)
    report = compare_steps(step(bundle.model, batch), step(candidate, batch))
    assert report.loss_identical and report.max_abs_grad_diff == 0.0, report.worst_param
    assert report.ok, report


def test_titan_layer_sac_checkpoints_every_nth_layer_whole_exactly():
    # torchtitan counts the layers it wraps from 1 and checkpoints every N-th: with N = 2, the
    # 2nd and 4th of four. The step holds between no checkpointing and every layer whole, and
    # its gradients are the no-checkpoint step's (without dropout: torchtitan's wrapper does not
    # restore the RNG state for the replay, so a model with dropout would draw other masks).
    import copy

    from actplan._install.baselines import baseline
    from actplan.measure import capture_step, compare_steps
    from actplan.models import build_model, train_step

    bundle = build_model("dense", "tiny", n_layers=4)
    candidate = copy.deepcopy(bundle.model)
    baseline("titan-layer-sac:2")(candidate)
    assert ["forward" in vars(layer) for layer in candidate.layers] == [False, True, False, True]
    batch = bundle.batch(0)
    report = compare_steps(
        capture_step(bundle.model, train_step(bundle.model, batch, seed=7)),
        capture_step(candidate, train_step(candidate, batch, seed=7)),
    )
    assert report.loss_identical and report.max_abs_grad_diff == 0.0, report.worst_param
    four = replace(SMALL, layers=4)
    held = {p: rank_step(four, p, 1, "h100").activation_bytes for p in ("none", "titan-layer-sac:2", "full")}
    assert held["full"] < held["titan-layer-sac:2"] < held["none"]


def test_a_latent_attention_shape_that_does_not_fit_together_is_named():
    with pytest.raises(ValueError, match="needs qk_nope_head_dim, qk_rope_head_dim, v_head_dim as well"):
        replace(SMALL, kv_lora_rank=16).check()
    with pytest.raises(ValueError, match=r"qk_rope_head_dim \(7\) must be even"):
        replace(SMALL_MLA, qk_rope_head_dim=7).check()
    with pytest.raises(ValueError, match="head_dim does not apply to multi-head latent attention"):
        replace(SMALL_MLA, head_dim=16).check()
    with pytest.raises(ValueError, match="router 'top1'"):
        replace(SMALL_MOE, router="top1").check()


def test_the_deepseek_v3_shape_splits_heads_and_experts_per_rank():
    from actplan.measure import FakeRun
    from actplan.models import build_model

    shape = load_shape("deepseek-v3")
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab) == (61, 7168, 128, 129280)
    assert "latent attention: q rank 1536, kv rank 512, qk 128+64, v 128" in shape.describe()
    rank = shape.per_rank(tp=8, ep=8)
    assert (rank.heads, rank.ffn, rank.shared_ffn, rank.vocab, rank.head_dim) == (16, 2304, 256, 16160, None)
    assert (rank.q_lora_rank, rank.kv_lora_rank, rank.experts) == (1536, 512, 256)
    with FakeRun():  # one rank's dense prefix and a MoE layer: 16 heads, latents whole, 32 experts
        model = build_model("moe", "small", **replace(rank, layers=4, seq=64).model_overrides()).model
    attn, moe = model.layers[3].attn, model.layers[3].moe
    assert tuple(attn.q_b_proj.weight.shape) == (16 * 192, 1536)
    assert tuple(attn.kv_a_proj_with_mqa.weight.shape) == (512 + 64, 7168)
    assert tuple(attn.o_proj.weight.shape) == (7168, 16 * 128)
    assert moe.experts.w_gate.shape[0] == 32 and model.config.router == "sigmoid"
    assert tuple(model.freqs_cis.shape) == (64, 32)  # RoPE on the 64-wide rotary part only


DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_nextn_predict_layers": 1, "routed_scaling_factor": 2.5, "vocab_size": 129280,
    "rope_scaling": {"type": "yarn", "factor": 40},
}  # fmt: skip


def test_a_deepseek_v3_config_maps_onto_the_shipped_shape(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    expected = replace(load_shape("deepseek-v3"), name="deepseek_v3", hf_config=str(path))
    assert shape_from_hf_config(path) == expected
    # transformers writes head_dim = qk_rope_head_dim; it does not size latent attention's heads
    path.write_text(json.dumps({**DEEPSEEK_V3_CONFIG, "head_dim": 64}))
    assert shape_from_hf_config(path).head_dim is None
    # DeepSeek-V2-Lite: queries projected directly, no query latent
    path.write_text(json.dumps({**DEEPSEEK_V3_CONFIG, "q_lora_rank": None}))
    lite = shape_from_hf_config(path, seq=32)
    assert lite.mla and lite.q_lora_rank is None


@pytest.mark.parametrize(
    "shape", [replace(SMALL, layers=7), replace(SMALL_MOE, layers=8)], ids=["dense", "moe"]
)
def test_a_shallow_profile_deepened_predicts_what_the_deep_profile_predicts(shape):
    from actplan.measure import FakeRun
    from actplan.models import build_model
    from actplan.planning._estimate_plans import deepened
    from actplan.planning.profile import profile_model

    def profile(layers: int):
        with FakeRun() as fake:
            bundle = build_model(shape.model, "small", **replace(shape, layers=layers).model_overrides())
            return profile_model(bundle, spec="x", device=fake.device, gpu="h100", progress=lambda e: None)

    base = preset_step(shape, "none", "h100")[0].seconds  # the estimate's `none` row
    deep = profile(shape.layers)
    shallow = deepened(profile((shape.first_k_dense or 0) + 4), shape.layers, base)
    assert base == pytest.approx(deep.base_seconds, rel=1e-9)
    assert shallow.layer_type_of == deep.layer_type_of
    assert shallow.param_bytes == deep.param_bytes
    # AdamW's two moments per parameter; its 4-byte step counters are left out.
    assert shallow.optimizer_bytes == pytest.approx(deep.optimizer_bytes, rel=1e-3)
    # Static memory and the optimizer step's temporaries are the estimate's formula.
    a, b = (replace(p.problem(), static_bytes=0.0, optimizer_step_bytes=0.0) for p in (deep, shallow))
    names = [[c.name for c in candidates] for candidates in a.layers]
    for pick in ("none", "full", "matmuls", "mixed"):
        choices = [
            row.index("full" if pick == "mixed" and i % 2 else ("none" if pick == "mixed" else pick))
            for i, row in enumerate(names)
        ]
        assert b.peak(choices) == pytest.approx(a.peak(choices), rel=1e-6), pick
        assert b.seconds(choices) == pytest.approx(a.seconds(choices), rel=1e-6), pick


def test_a_budget_no_plan_reaches_states_the_feasible_range(tmp_path, capsys):
    args = ["estimate", "--model", "dense", "--layers", "2", "--hidden", "128", "--heads", "4", "--quiet"]
    args += ["--kv-heads", "2", "--ffn", "512", "--vocab", "1024", "--seq", "256", "--batch", "2"]
    plan = tmp_path / "plan.yaml"  # the CUDA context alone is over 2 MiB
    assert main([*args, "--presets", "none", "--budget", "2MiB", "--out", str(plan)]) == 1
    printed = " ".join(capsys.readouterr().out.split())
    assert "no plan: no plan fits a budget of 2.0 MiB: the CUDA context and NCCL's buffers" in printed
    assert "no plan written" in printed and not plan.exists()


@pytest.mark.parametrize(
    "optimizer,impl,fsdp,tp",
    [("AdamW", "foreach", 4, 1), ("AdamW", "fused", 2, 2), ("Adam", "for-loop", 4, 1),
     ("SGD", "foreach", 2, 2)],
)  # fmt: skip
def test_an_elementwise_optimizer_on_local_shards_holds_what_it_holds_on_dtensors(
    monkeypatch, optimizer, impl, fsdp, tp
):
    # The estimate steps AdamW, Adam and SGD on each rank's local shards (DTensor's sharding
    # propagation is a third of an estimated step's time): every figure is the one stepping the
    # DTensor parameters gives.
    from actplan.planning import _training

    setup = TrainingSetup(optimizer=optimizer, optimizer_impl=impl)
    local = rank_step(SMALL, "full", fsdp, "h100", tp=tp, training=setup)
    monkeypatch.setattr(_training, "ELEMENTWISE", ())
    on_dtensors = rank_step(SMALL, "full", fsdp, "h100", tp=tp, training=setup)
    assert local == on_dtensors


def test_a_hugging_face_config_follows_the_numbers_given_on_top_of_it(tmp_path):
    # --layers carries per-layer lists (layer_types) to the new depth; --hidden moves a head size
    # the file states (hidden / heads); the class built is the shape described.
    pytest.importorskip("transformers")
    from actplan.models import build_for_shape

    path = _tiny_hf_config(tmp_path, model_type="qwen3", head_dim=16, layer_types=["full_attention"] * 2)
    shape = replace(shape_from_hf_config(path, seq=32, batch=2, dtype="fp32"), layers=5, hidden=128)
    model = build_for_shape(shape).model
    assert len(model.model.layers) == 5 and model.config.layer_types == ["full_attention"] * 5
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 128)
    assert rank_step(replace(shape, layers=3), "full", 2, "h100").parameters == sum(
        p.numel() for p in build_for_shape(replace(shape, layers=3)).model.parameters()
    )


def test_a_torchtitan_flavour_is_read_from_torchtitans_own_registry():
    pytest.importorskip("torchtitan")
    from actplan.models.titan import shape_from_titan

    shape = shape_from_titan("llama3:8B", seq=4096)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab) == (
        32, 4096, 32, 8, 14336, 128256,
    )  # fmt: skip
    assert shape.seq == 4096 and shape.titan == "llama3:8B" and "torchtitan" in shape.code
    qwen = shape_from_titan("qwen3:0.6B")  # heads of 128 on a hidden of 1024
    assert qwen.head_dim == 128 and qwen.heads * 128 != qwen.hidden


@pytest.mark.parametrize(
    "spec,given,message",
    [
        ("llama3", {}, "give MODEL:FLAVOR, for example llama3:8B"),
        ("llama3:9B", {}, "no flavour '9B'; llama3's flavours: debugmodel, 1B"),
        ("nosuch:1B", {}, "torchtitan has no model 'nosuch'"),
        ("llama3:8B", {"hidden": 1024}, "--hidden would change torchtitan's model"),
        ("qwen3:30B-A3B", {}, "has MoE layers"),
    ],
)
def test_a_torchtitan_spec_it_cannot_build_is_refused_by_name(spec, given, message):
    pytest.importorskip("torchtitan")
    from actplan.models.titan import shape_from_titan

    with pytest.raises(ValueError, match=re.escape(message)):
        shape_from_titan(spec, **given)


@pytest.mark.parametrize("preset", ["none", "full", "titan-op-sac"])
@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "fsdp2-tp2"])
def test_torchtitans_own_llama_steps_fake_as_real(preset, tp):
    # torchtitan's code (complex fp32 RoPE, fused QKV, fp32 loss) through actplan.parallelize's
    # FSDP2, split first by torchtitan's own tensor parallelism (its sharding declarations:
    # vocabulary-parallel embedding, sequence-parallel norms, its loss-parallel cross-entropy):
    # the fake step measures what the same step measures on real tensors.
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.utils import get_spmd_backend

    from actplan.models.titan import shape_from_titan

    shape = shape_from_titan("llama3:debugmodel", layers=2, seq=32, batch=2, dtype="fp32")
    backend = get_spmd_backend()
    fake = rank_step(shape, preset, 2, "h100", tp=tp)
    real = rank_step(shape, preset, 2, "h100", tp=tp, fake=False)
    assert get_spmd_backend() == backend  # torchtitan's process-wide setting, set for the forward only
    assert _untimed(fake) == _untimed(real)
    assert fake.activation_bytes > 0
    if tp > 1:  # a rank holds its share of the heads and of the sequence, not the whole layer
        whole = rank_step(shape, preset, 4, "h100")
        assert fake.activation_bytes < 0.75 * whole.activation_bytes


@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "fsdp2-tp2"])
def test_a_plan_estimated_on_torchtitans_model_installs_on_that_model(tp):
    # The plans are profiled on torchtitan's own blocks (under TP, one rank's share of them as
    # torchtitan splits them: DTensors in and out of each block), so their units and made_for
    # block are those of the model a torchtitan user trains, and actplan.apply takes the plan there.
    pytest.importorskip("torchtitan")
    import actplan
    from actplan.models.titan import shape_from_titan, titan_model

    shape = shape_from_titan("llama3:debugmodel", layers=2, seq=64, batch=2, dtype="bf16")
    result = estimate(shape, ("none",), fsdp=2, tp=tp, plans=True)
    assert result.plans
    for row in result.plans:
        config = RecomputeConfig.from_yaml(row.plan_yaml)
        assert config.made_for.model == "llama3:debugmodel"
        assert dict(config.made_for.layer_classes) == {"Llama3TransformerBlock": "0-1"}
        model, _, _ = titan_model(shape)
        plan = actplan.apply(model.decoder, config)
        assert [layer.class_name for layer in plan.layers] == ["Llama3TransformerBlock"] * 2


def test_expert_weights_fsdp_leaves_out_are_cast_by_the_module_or_refused():
    """(Here, not in test_parallel, whose tests keep a process group: this one starts torch's
    fake group.) Under a mixed-precision policy FSDP casts the parameters it gathers; expert-parallel
    weights, which it leaves out, are cast by their module's ``compute_dtype``, and a module
    without one is refused (its GEMMs would meet bf16 activations with fp32 weights)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from actplan._install.parallel import parallelize
    from actplan.models import build_model
    from actplan.planning._rank_step import fake_world

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2, 4, 4))
            self.expert_parallel_group = dist.group.WORLD

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            moe = build_model("moe", "tiny", ep_group=dist.group.WORLD).model
        parallelize(moe, mesh, "none", mp_policy=policy)
        experts = [m for m in moe.modules() if getattr(m, "expert_parallel_group", None) is not None]
        assert experts and all(m.compute_dtype == torch.bfloat16 for m in experts)
        with pytest.raises(ValueError, match="give the module a `compute_dtype` attribute"):
            parallelize(torch.nn.Sequential(Experts()), mesh, "none", mp_policy=policy)


def test_a_stepped_plan_pinning_past_the_host_budget_is_planned_again_under_less():
    # The offload pool rounds each buffer up to a size class, so a stepped plan may pin more
    # host memory than the planner counted: plan_within then plans again under a host budget
    # lowered by the excess, until the stepped plan keeps within it. The step here stands for
    # such a pool (it pins a quarter more than the plan moves); the planner is the estimate's.
    from types import SimpleNamespace

    from actplan.planning._estimate_plans import Planner, plan_within, planner_for, shallow_profile
    from actplan.planning.planner import none_peak, solve

    profile = shallow_profile(MEDIUM, "h100")
    free = planner_for(profile, MEDIUM, "h100", 0, profile.base_seconds)
    target = int(free.minimum + 0.25 * (none_peak(free.problem) - free.minimum))
    host = int(free.problem.host_bytes(solve(free.problem, target).choices))  # what it offloads there
    assert host > 0
    planned: list[tuple[int, int, float]] = []  # (host budget, host bytes moved, predicted peak)

    class Recording(Planner):
        def plan(self, budget, gpu_budget):
            solution = solve(self.problem, budget)
            moved = int(self.problem.host_bytes(solution.choices))
            planned.append((self.problem.host_budget_bytes, moved, solution.predicted_peak_bytes))
            return super().plan(budget, gpu_budget)

    base = planner_for(profile, MEDIUM, "h100", 0, profile.base_seconds, host_budget=host)
    planner = Recording(base.profile, base.problem, base.minimum, base.made_for)

    def step(config):  # fits the device; pins a quarter more than the plan moves
        _, moved, peak = planned[-1]
        pool = SimpleNamespace(host_bytes=int(1.25 * moved))
        return SimpleNamespace(reserved_peak_bytes=int(peak), moved=pool)

    said: list[str] = []
    row = plan_within(planner, target, 0, step, said.append, refused := [])
    assert planned[0][:2] == (host, host)  # the first plan fills the host budget; its pool does not fit
    assert any("over the host budget: planning again under less" in line for line in said)
    budgets = [budget for budget, _, _ in planned]
    assert len(budgets) > 1 and budgets == sorted(budgets, reverse=True)
    assert all(moved <= budget for budget, moved, _ in planned)
    assert row is not None and not refused
    assert row.moved.host_bytes <= host  # the plan as stepped keeps within the budget it was given
