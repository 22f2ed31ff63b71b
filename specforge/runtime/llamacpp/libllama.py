"""The llama.cpp C API through llama-cpp-python's ctypes bindings, loaded once per process.

llama-cpp-python declares every C function of ``llama.h`` on its loaded library; the layer-input
API that taps hidden states (``src/llama-ext.h``) has C++ linkage and no declaration there, so it
is reached here by its mangled symbol.  A binding that is missing, built for another CPU, or lacks
that API is a :class:`BindingError` whose message says what to run — never a crash: a wheel built
with another CPU's instructions would die of SIGILL, which is why the environment's recorded CPU
key (:mod:`specforge.runtime.llamacpp.build`) is checked before the library is loaded.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from specforge.errors import SpecforgeError
from specforge.runtime.llamacpp.build import cpu_key, installed_key

__all__ = ["INSTALL", "Binding", "BindingError", "load"]

INSTALL = "make install (or: python -m specforge.runtime.llamacpp.build)"
_SET_LAYER_INP = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
_GET_LAYER_INP = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"


class BindingError(SpecforgeError, RuntimeError):
    """The llama.cpp binding cannot be used here; the message names the fix."""


@dataclass(frozen=True)
class Binding:
    api: Any  # the ``llama_cpp.llama_cpp`` module: one Python function per C function
    version: str
    set_layer_inp: Any  # (ctx, layer, bool) -> None
    get_layer_inp: Any  # (ctx, layer) -> float* ([n_batch, n_embd], this pass's tokens first)


_LOG_SINK: Any = None  # the no-op log callback; kept alive for the process (C holds the pointer)


@lru_cache(maxsize=1)
def load() -> Binding:
    """The loaded binding (one per process)."""
    built_for = installed_key()
    if built_for is not None and built_for != cpu_key():
        raise BindingError("the llama.cpp binding in this environment was built for another CPU (its instructions "
                           f"may not exist here); rebuild it for this one: {INSTALL} — or use target.backend=torch")
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as api
    except ImportError as exc:
        raise BindingError(f"the llama.cpp binding (llama-cpp-python) is not installed: {INSTALL} — or use "
                           f"target.backend=torch ({exc})") from exc
    except OSError as exc:  # the shared library itself did not load
        raise BindingError(f"the llama.cpp library did not load ({exc}); rebuild it: {INSTALL}") from exc
    lib = api._lib
    try:
        set_inp, get_inp = lib[_SET_LAYER_INP], lib[_GET_LAYER_INP]
    except AttributeError as exc:
        raise BindingError(f"llama-cpp-python {llama_cpp.__version__} exports no layer-input API "
                           f"(llama_set_embeddings_layer_inp); install the one specforge builds: {INSTALL}") from exc
    set_inp.argtypes, set_inp.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
    get_inp.argtypes, get_inp.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
    global _LOG_SINK
    _LOG_SINK = api.llama_log_callback(lambda level, text, user_data: None)
    api.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))
    api.llama_backend_init()
    return Binding(api=api, version=llama_cpp.__version__, set_layer_inp=set_inp, get_layer_inp=get_inp)
