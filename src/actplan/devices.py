"""Device names as users give them (``--device``): ``auto``, ``cpu``, ``cuda``, ``cuda:<index>``.

One resolver for the command line, the bench and the harness scripts, so that a missing or
unknown device is the same clear error everywhere. A leaf module: imports only torch.
"""

from __future__ import annotations

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:<index>"
"""What ``resolve_device`` accepts, for error and help texts."""


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when there is one), ``cpu``, ``cuda`` or ``cuda:<index>`` as a device.

    Raises ``ValueError`` naming the valid choices for anything else, and saying why for a
    CUDA device this process cannot use (no CUDA build, none visible, index out of range).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; valid choices: {DEVICE_CHOICES}")
    if device.type == "cuda":
        _check_cuda(name, device)
    return device


def _check_cuda(name: str, device: torch.device) -> None:
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(
            f"device {name!r} is not available: {why} (torch {torch.__version__}); "
            "use --device cpu, or auto (CUDA when there is one)"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {name!r} is not available: {torch.cuda.device_count()} CUDA device(s) visible "
            f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
        )
