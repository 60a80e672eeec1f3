"""Installing a config on a model: resolve it to a per-layer plan, wrap the layers, and the
FSDP2 / expert-parallel composition. Private: ``actplan`` re-exports the public names."""
