"""Training data: ShareGPT and JSONL conversations, their regeneration by the target, and their
tokenisation with a loss mask.

The submodules import nothing heavy at import time (torch and transformers only when a
conversation is tokenised), so loading prompts stays quick.  Its names are imported on first use
(PEP 562): the plug-in authors' toolkit reads the conversation files through two leaf modules
(:mod:`.jsonl`, :mod:`.chat`; :mod:`specforge.toolkit.corpus`), and importing a leaf runs this
file first — it must not pull in regeneration and the engine with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specforge.lazy import lazy_getattr

if TYPE_CHECKING:  # what type checkers and the API docs (griffe) read; at run time, __getattr__ below
    from specforge.data.chat import ChatTemplateError, Conversation, TokenizedChat, tokenize_conversation
    from specforge.data.jsonl import JsonlReport, LineError, iter_jsonl, load_jsonl
    from specforge.data.regeneration import RegenerationError, RegenerationReport, iter_regenerated, regenerate
    from specforge.data.sharegpt import ShareGPTReport, find_sharegpt_file, iter_sharegpt, load_sharegpt

_LAZY = {"ChatTemplateError": "chat", "Conversation": "chat", "TokenizedChat": "chat", "tokenize_conversation": "chat",
         "JsonlReport": "jsonl", "LineError": "jsonl", "iter_jsonl": "jsonl", "load_jsonl": "jsonl",
         "RegenerationError": "regeneration", "RegenerationReport": "regeneration", "iter_regenerated": "regeneration",
         "regenerate": "regeneration", "ShareGPTReport": "sharegpt", "find_sharegpt_file": "sharegpt",
         "iter_sharegpt": "sharegpt", "load_sharegpt": "sharegpt"}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
