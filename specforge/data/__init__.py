"""Training data: ShareGPT and JSONL conversations, their regeneration by the target, and their
tokenisation with a loss mask.

The submodules import nothing heavy at import time (torch and transformers only when a
conversation is tokenised), so loading prompts stays quick.
"""

from specforge.data.chat import ChatTemplateError, Conversation, TokenizedChat, tokenize_conversation
from specforge.data.jsonl import JsonlReport, LineError, iter_jsonl, load_jsonl
from specforge.data.regenerate import RegenerationError, RegenerationReport, iter_regenerated, regenerate
from specforge.data.sharegpt import ShareGPTReport, find_sharegpt_file, iter_sharegpt, load_sharegpt

__all__ = [
    "ChatTemplateError",
    "Conversation",
    "JsonlReport",
    "LineError",
    "RegenerationError",
    "RegenerationReport",
    "ShareGPTReport",
    "TokenizedChat",
    "find_sharegpt_file",
    "iter_jsonl",
    "iter_regenerated",
    "iter_sharegpt",
    "load_jsonl",
    "load_sharegpt",
    "regenerate",
    "tokenize_conversation",
]
