"""Triton kernels, each with a pure-torch reference twin that computes the same function.

On a CPU the twins run; the Triton versions run on a GPU, and in tests under
``TRITON_INTERPRET=1``, where they are checked against their twins.
"""
