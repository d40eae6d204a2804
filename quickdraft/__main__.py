"""``python -m quickdraft``: the same command line as the ``quickdraft`` script."""

import sys

from quickdraft.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
