"""The llama.cpp sibling of the runtime: a GGUF target's passes in libllama.

* :mod:`.build` — llama-cpp-python built once per CPU (its instructions recorded), and the tools'
  folder ``make llama.cpp`` fills;
* :mod:`.libllama` — llama.cpp's C API through that binding's ctypes declarations, loaded once;
* :mod:`.backend` — the target backend over it (sequences as cache slots, layer inputs as taps);
* :mod:`.write_gguf` — a small Hugging Face Llama written as a GGUF (the conformance suite's
  reference targets, fast tests of the backend).

Nothing here imports the binding at import time: a machine without it runs every job on the torch
sibling, and only a target that asks for llama.cpp loads it (with the install command when absent).
"""
