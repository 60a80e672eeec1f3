"""``python -m bench.peers``: see ``bench.peers.main``."""

from bench.peers.main import main

raise SystemExit(main())
