"""specforge: lossless speculative decoding as composable plug-ins.

A plug-in author needs :data:`hookimpl` and the specs in :mod:`specforge.hookspecs`.
"""

from importlib import metadata as _metadata

from specforge.hookspecs import hookimpl

try:
    __version__ = _metadata.version("specforge-lossless")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = ["__version__", "hookimpl"]
