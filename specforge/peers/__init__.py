"""Clients of the engines specforge does not own, one module per peer, used by both the benchmarks
(:mod:`specforge.bench`) and the conformance suite's black-box tier (``specforge_conformance``).

* :mod:`.vllm` — vLLM's CPU build in its own virtual environment, driven through
  :mod:`.vllm_runner` (timed decoding) and :mod:`.vllm_sampler` (the black-box tier's draws), two
  standalone scripts that run inside that environment and import vLLM, never specforge;
* :mod:`.llama_server` — ``llama-server`` as a process on the loopback;
* :mod:`.llamacpp_tools` — llama.cpp's command-line programs as ``make llama.cpp`` builds them;
* :mod:`.llamacpp` — llama.cpp decoding a GGUF its own way (the binding's generation loop and
  ``llama-server``'s slots), the engine benchmark's llama.cpp rows;
* :mod:`.drafter_peers` — a drafter trained here, served by vLLM or llama.cpp as its speculative
  model;
* :mod:`.records` — the record every peer's measurement returns.

A peer reaches specforge's runtime only to find files (:mod:`specforge.model_files`) and the
llama.cpp binding specforge builds; it never runs the engine.
"""
