"""``python -m bench.planner``: see ``bench.planner.main``."""

from bench.planner.main import main

raise SystemExit(main())
