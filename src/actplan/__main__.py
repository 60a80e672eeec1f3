import sys

from actplan.cli import main

sys.exit(main())
