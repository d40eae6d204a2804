"""``python -m quickdraft``: the same command line as the ``quickdraft`` script."""

from quickdraft.server.cli import main

if __name__ == "__main__":
    main()
