"""The planner's plan half way between its lowest predicted peak and no checkpointing's, for the
tests that run a planner plan across ranks (``test_tp.py``, ``test_torchtitan_tp.py``): made in
the pytest process, written to a file, and handed to every rank."""

from __future__ import annotations

import torch

from actplan.models import ModelBundle
from actplan.planning.choose import config_for
from actplan.planning.planner import minimum_peak, solve
from actplan.planning.profile import profile_model


def half_way_plan(bundle: ModelBundle, spec: str) -> dict:
    """Profile ``bundle`` whole in this process and solve at the budget half way between the
    lowest predicted peak and no checkpointing's: the config, and the figures it was chosen by."""
    # Times from H100's roofline, not this machine's clock: the same plan on every run.
    profile = profile_model(
        bundle, spec=spec, device=torch.device("cpu"), repeats=1, min_bytes=0, gpu="h100",
        progress=lambda event: None,
    )  # fmt: skip
    problem = profile.problem()
    lowest, _ = minimum_peak(problem)
    solution = solve(problem, (lowest + profile.none_peak_bytes) / 2)
    return {
        "config": config_for(profile, solution.choices).to_dict(),
        "names": list(solution.names),
        "predicted_peak_bytes": solution.predicted_peak_bytes,
        "lowest_peak_bytes": lowest,
        "none_peak_bytes": profile.none_peak_bytes,
    }
