import sys

from actplan.cli import main

if __name__ == "__main__":  # not when a worker process (spawn) imports this module again
    sys.exit(main())
