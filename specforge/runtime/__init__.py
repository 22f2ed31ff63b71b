"""The target runtime: what computes a target's passes, behind one contract.

* :mod:`.contract` — what the engine may ask of a target's passes (``new_cache``, ``forward``), what
  a caller needs of them (:class:`~.contract.Needs`) and the cache slots every backend keeps;
* :mod:`.torch` — the torch sibling: specforge's own transformer, its precisions and KV cache;
* :mod:`.llamacpp` — the llama.cpp sibling: a GGUF in libllama through the binding specforge builds;
* :mod:`.choice` — which of the two computes the passes, decided once;
* :mod:`.load` — :func:`load_target`, the one way a job gets a :class:`TargetModel`;
* :mod:`.target` — :class:`TargetModel`, what the engine, drafters and trainers talk to.

Below it (and so free for the toolkit and plug-ins to read): the shapes and files of a target
(:mod:`specforge.model_args`, :mod:`specforge.model_files`), the batch layout of a pass
(:mod:`specforge.passes`), the projection's kernel plan (:mod:`specforge.toolkit.linear_plan`).

Its names are imported on first use (PEP 562), so importing a leaf of the runtime does not load
the model code and Hugging Face with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specforge.lazy import lazy_getattr

if TYPE_CHECKING:  # what type checkers and the API docs (griffe) read; at run time, __getattr__ below
    from specforge.runtime.contract import CacheFullError, Needs
    from specforge.runtime.load import load_target
    from specforge.runtime.target import TargetModel
    from specforge.runtime.torch.cache import KVCache

_LAZY = {"CacheFullError": "contract", "KVCache": "torch.cache", "Needs": "contract", "TargetModel": "target",
         "load_target": "load"}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
