"""Planning under a memory budget: profile each layer type's candidates (``profile``), cache
them (``cache``), solve for the fastest plan under the budget (``planner``), turn the plan into
a config (``choose``) and write, run and check it (``budget``); ``plot`` draws the trade-off.

Needs the ``plan`` extra (numpy, scipy; checked here, on first import) and, for plots, the
``cli`` extra (matplotlib).
"""

from actplan.planning._extra import require

require("numpy", "scipy")
