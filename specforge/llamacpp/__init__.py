"""llama.cpp inside specforge: the Python binding (built once per CPU and cached), the C API it
exposes through ctypes, and the target backend on top of it (:mod:`specforge.target.llamacpp`).

Nothing here imports the binding at import time: a machine without it runs every job on the torch
runtime, and only ``target.backend: llama.cpp`` asks for it (with the install command when absent).
"""
