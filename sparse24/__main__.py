"""``python -m sparse24 ...`` and the ``sparse24`` console script (see :mod:`sparse24.tools.cli`)."""
import sys

from .tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
