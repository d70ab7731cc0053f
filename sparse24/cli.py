"""Old import path of :mod:`sparse24.tools.cli` (the same module object)."""
import sys

from .tools import cli

sys.modules[__name__] = cli
