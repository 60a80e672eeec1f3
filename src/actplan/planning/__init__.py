"""Planning under a memory budget: profile each layer type's candidates (``profile``), cache
them (``cache``), solve for the fastest plan under the budget (``planner``) and write, run and
check it (``budget``). Needs the ``plan`` extra (scipy) for the MILP oracle and the ``cli``
extra (matplotlib) for plots."""
