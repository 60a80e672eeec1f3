"""Model factories for the planner tests, importable as ``plan_models:<name>`` (the
``--model package.module:factory`` form): tiny reference models with batches long enough
that activations, not weights and optimizer state, set the peak."""

from actplan.models import build_model


def dense_long():
    bundle = build_model("dense", "tiny", batch_size=16, seq_len=64)
    return bundle.model, bundle.make_batch


def moe_long():
    return build_model("moe", "tiny", batch_size=16, seq_len=64)


def not_a_pair():
    return 42
