"""Old import path of :mod:`sparse24.tools.demo` (the same module object)."""
import sys

from .tools import demo

sys.modules[__name__] = demo
