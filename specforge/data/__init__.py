"""Training data: ShareGPT and JSONL conversations, and their tokenisation with a loss mask.

The submodules import nothing heavy at import time (torch and transformers only when a
conversation is tokenised), so loading prompts stays quick.
"""

from specforge.data.chat import ChatTemplateError, Conversation, TokenizedChat, tokenize_conversation
from specforge.data.jsonl import JsonlReport, LineError, iter_jsonl, load_jsonl
from specforge.data.sharegpt import ShareGPTReport, find_sharegpt_file, iter_sharegpt, load_sharegpt

__all__ = [
    "ChatTemplateError",
    "Conversation",
    "JsonlReport",
    "LineError",
    "ShareGPTReport",
    "TokenizedChat",
    "find_sharegpt_file",
    "iter_jsonl",
    "iter_sharegpt",
    "load_jsonl",
    "load_sharegpt",
    "tokenize_conversation",
]
