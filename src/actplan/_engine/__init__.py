"""The engine: keep, recompute and offload, per op, inside checkpointed layers.

Private: the public names are re-exported by ``actplan``. Modules here import only the
foundations (``actplan.units``, ``actplan.markers``, ``actplan.sizes``, ``actplan._storage``)
and each other, never config, install, planning, integrations or the CLI
(``tests/test_architecture.py`` checks it; ``docs/architecture.md`` draws it).
"""
