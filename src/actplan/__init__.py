"""actplan: decide, per activation, keep / recompute / offload, and apply it exactly."""
