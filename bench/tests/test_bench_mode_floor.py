"""bench.mode_floor: the ops actplan's segment modes see, counted at the mode."""

from bench.mode_floor import intercepted_ops_per_layer_step


def test_full_on_moe_is_seen_only_in_its_routing_stretches():
    # Under `full` the engine watches the router and dispatch stretches of each MoE layer (forward
    # and replay) and nothing of the dense first layer: a few dozen ops per layer, not the
    # hundreds a whole-layer mode would see.
    ops = intercepted_ops_per_layer_step(steps=1)
    assert 10 < ops < 80
