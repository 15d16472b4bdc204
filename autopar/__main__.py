"""``python -m autopar``: the same command line as ``autopar``."""

import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main())
