"""Target models: loading, the flattened-batch runtime and its KV cache.

Its names are imported on first use (PEP 562): the plug-in authors' toolkit reads two leaf modules
of this package (:mod:`.linear_plan`, :mod:`.compiled`, for :mod:`specforge.toolkit.projection`),
and importing a leaf runs this file first — it must not load the runtime and Hugging Face with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specforge.lazy import lazy_getattr

if TYPE_CHECKING:  # what type checkers and the API docs (griffe) read; at run time, __getattr__ below
    from specforge.target.adapter import TargetModel
    from specforge.target.args import ModelArgs, UnsupportedModelError
    from specforge.target.batch import VarlenBatch
    from specforge.target.cache import CacheFullError, KVCache
    from specforge.target.loading import TargetLoadError

_LAZY = {"CacheFullError": "cache", "KVCache": "cache", "ModelArgs": "args", "TargetLoadError": "loading",
         "TargetModel": "adapter", "UnsupportedModelError": "args", "VarlenBatch": "batch"}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
