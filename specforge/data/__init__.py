"""Training data: ShareGPT conversations and their regeneration by the target.

The conversation format itself — JSONL files, messages, tokenisation with a loss mask — is
:mod:`specforge.conversations`, below this package, since the plug-in authors' toolkit reads it
too.  Names are imported on first use (PEP 562), so loading prompts never pulls in regeneration
and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specforge.lazy import lazy_getattr

if TYPE_CHECKING:  # what type checkers and the API docs (griffe) read; at run time, __getattr__ below
    from specforge.data.regeneration import RegenerationError, RegenerationReport, iter_regenerated, regenerate
    from specforge.data.sharegpt import ShareGPTReport, find_sharegpt_file, iter_sharegpt, load_sharegpt

_LAZY = {"RegenerationError": "regeneration", "RegenerationReport": "regeneration", "iter_regenerated": "regeneration",
         "regenerate": "regeneration", "ShareGPTReport": "sharegpt", "find_sharegpt_file": "sharegpt",
         "iter_sharegpt": "sharegpt", "load_sharegpt": "sharegpt"}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
