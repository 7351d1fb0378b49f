"""irgen: custom IR and golden data from TVM"""

from irgen.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
