"""Old import path of :mod:`sparse24.tools.shapes` (the same module object)."""
import sys

from .tools import shapes

sys.modules[__name__] = shapes
