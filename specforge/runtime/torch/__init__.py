"""The torch sibling of the runtime: specforge's own flattened-batch transformer
(:mod:`.model`), its KV cache (:mod:`.cache`), the precisions it measures per pass size
(:mod:`.precision`), a GGUF's 4-bit blocks run as stored (:mod:`.quantized`), the compiled
forward's verdict (:mod:`.compile_choice`) and the backend the engine calls (:mod:`.backend`).
"""
