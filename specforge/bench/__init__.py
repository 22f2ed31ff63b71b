"""Benchmarks: prompts, the HF transformers baseline and the vLLM CPU peer."""
