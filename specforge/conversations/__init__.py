"""The conversation files specforge reads: one JSON object per line, messages with roles, and their
tokenisation with a loss mask (docs/data.md).

A foundation package: the data jobs (:mod:`specforge.data`: ShareGPT, regeneration) and the
plug-in authors' toolkit (:mod:`specforge.toolkit.corpus`, a drafter's corpus) both read this
format, so it sits below both and imports nothing of specforge but the error types.
"""
