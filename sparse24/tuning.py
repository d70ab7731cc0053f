"""Old import path of :mod:`sparse24.tools.tuning` (the same module object)."""
import sys

from .tools import tuning

sys.modules[__name__] = tuning
