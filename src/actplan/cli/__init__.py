"""The ``actplan`` command line: ``bench`` (the main job), ``profile``, ``plan``, ``verify``,
``explain`` and ``units``.

Top of the import picture: it may use everything, nothing imports it. This module keeps only
``main`` (the console script), which picks the command by name; the parser is ``_parser``
(it imports no command), the tables ``_tables``, and each command lives in ``_bench``,
``_estimate``, ``_plan`` or ``_inspect``. rich (and matplotlib, for plots) come
with ``pip install 'actplan[cli]'``: ``main`` checks for rich before importing any of them.
"""

from __future__ import annotations

import importlib.util
import sys

CLI_EXTRA_HINT = "actplan's command line needs rich: pip install 'actplan[cli]'"


def main(argv: list[str] | None = None) -> int:
    if importlib.util.find_spec("rich") is None:
        print(CLI_EXTRA_HINT, file=sys.stderr)
        return 2
    from actplan.cli._bench import bench
    from actplan.cli._console import make_console
    from actplan.cli._estimate import estimate
    from actplan.cli._inspect import explain, units, verify
    from actplan.cli._parser import build_parser, check_arguments
    from actplan.cli._plan import plan, profile
    from actplan.config import ConfigError

    commands = {
        "bench": bench,
        "estimate": estimate,
        "explain": explain,
        "profile": profile,
        "plan": plan,
        "verify": verify,
        "units": units,
    }
    args = build_parser().parse_args(argv)
    console = make_console()
    try:
        check_arguments(args)
        return commands[args.command](args, console)
    except (ConfigError, ValueError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
