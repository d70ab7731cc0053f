"""Old import path of :mod:`sparse24.tools.plot` (the same module object)."""
import sys

from .tools import plot

sys.modules[__name__] = plot
