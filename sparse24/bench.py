"""Old import path of :mod:`sparse24.tools.bench` (the same module object)."""
import sys

from .tools import bench

sys.modules[__name__] = bench
