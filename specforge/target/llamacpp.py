"""The llama.cpp target backend: the engine's passes run in libllama on the GGUF file itself.

One engine pass is one ``llama_decode`` over every active request: request r is sequence id
``slot_r``, its new tokens carry their absolute positions, and only the rows the engine asks
logits for are outputs.  The KV cache is llama.cpp's, one *unified* buffer for all sequences:
the engine's runs have different lengths (one decoding token beside a 5-token verification beside
a 128-token prefill chunk), and with per-sequence buffers llama.cpp splits such a batch into
equal-length micro-batches — one pass would become many.  Rolling back after a rejection costs
nothing at crop time: the next pass of that slot first removes its entries from the write position
on (``llama_memory_seq_rm``), as the torch cache overwrites them.

Taps come from llama.cpp's layer-input extraction: the input of layer i + 1 is the residual stream
after layer i, for every token of the pass.  The output of the last layer has no such input, so a
drafter tapping it (Medusa) cannot run here — :meth:`LlamaCppBackend.check_taps` says so.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specforge.errors import SpecforgeError
from specforge.llamacpp.binding import Binding, load
from specforge.target.batch import VarlenBatch
from specforge.target.cache import SlotTable
from specforge.target.model import ForwardOutput

__all__ = ["BackendUnsupported", "LlamaCppBackend", "LlamaCppCache"]

# Tokens per llama_decode: one micro-batch (n_ubatch = n_batch), so a pass's layer inputs come
# back in the batch's own order.  A bigger pass is cut into several decodes, in order.
PASS_TOKENS = 512


class BackendUnsupported(SpecforgeError, ValueError):
    """A pass or a component this backend cannot compute exactly."""


class _Batch:
    """A reusable ``llama_batch`` over numpy arrays: filled with vectorised writes instead of one
    ctypes assignment per token and field (a 512-token prefill would cost 2,500 of them)."""

    def __init__(self, api: Any, capacity: int, sequences: int) -> None:
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        # seq_id[i] points at the one-element array holding token i's sequence id: a fixed table
        # of ids and a pointer array indexed by slot.
        self.ids = np.arange(sequences, dtype=np.int32)
        self.id_ptr = self.ids.ctypes.data + 4 * np.arange(sequences, dtype=np.uint64)
        self.seq_id = np.zeros(capacity, dtype=np.uint64)
        self.struct = api.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self.seq_id.ctypes.data, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, outputs: np.ndarray) -> int:
        n = len(tokens)
        self.token[:n], self.pos[:n], self.logits[:n] = tokens, positions, outputs
        self.seq_id[:n] = self.id_ptr[slots]
        self.struct.n_tokens = n
        return int(outputs.sum())


class LlamaCppCache(SlotTable):
    """The engine's cache contract over one llama.cpp context: slot s is sequence id s.

    Lengths, allocation and rollback are :class:`SlotTable`'s; the K/V live in llama.cpp, where a
    slot's entries past a crop stay until its next pass removes them (:meth:`prepare`)."""

    def __init__(self, backend: LlamaCppBackend, slots: int, capacity: int) -> None:
        super().__init__(slots, capacity)
        api = backend.binding.api
        params = api.llama_context_default_params()
        params.n_ctx = slots * capacity
        params.n_batch = params.n_ubatch = PASS_TOKENS
        params.n_seq_max = slots
        params.n_threads = params.n_threads_batch = backend.threads
        params.kv_unified = True
        params.no_perf = True
        self.ctx = api.llama_init_from_model(backend.model, params)
        if not self.ctx:
            raise MemoryError(f"llama.cpp could not create a context of {slots} × {capacity} positions")
        weakref.finalize(self, api.llama_free, self.ctx)
        self.api, self.binding = api, backend.binding
        self.memory = api.llama_get_memory(self.ctx)
        self.batch = _Batch(api, PASS_TOKENS, slots)
        self.kv_end = [0] * slots  # positions below this may hold K/V of the slot in llama.cpp
        self.taps: frozenset[int] = frozenset()  # layer inputs the context extracts

    def free(self, slot: int) -> None:
        super().free(slot)
        if self.kv_end[slot]:
            self.api.llama_memory_seq_rm(self.memory, slot, -1, -1)
            self.kv_end[slot] = 0

    def compact(self, slot: int, keep: list[int], start: int) -> None:
        if keep != list(range(start, start + len(keep))):
            raise BackendUnsupported("the llama.cpp backend verifies chains, not token trees")

    def prepare(self, slots: list[int], starts: list[int], ends: list[int]) -> None:
        """Before a pass writes ``starts[i]..ends[i]`` of ``slots[i]``: drop what an earlier pass
        left there (rejected drafts), so llama.cpp never sees two entries at one position."""
        for slot, start, end in zip(slots, starts, ends):
            if self.kv_end[slot] > start:
                self.api.llama_memory_seq_rm(self.memory, slot, start, -1)
            self.kv_end[slot] = end

    def extract(self, layers: frozenset[int]) -> None:
        """Extract the inputs of ``layers`` on the following passes (and no others)."""
        if layers != self.taps:
            for layer in self.taps - layers:
                self.binding.set_layer_inp(self.ctx, layer, False)
            for layer in layers - self.taps:
                self.binding.set_layer_inp(self.ctx, layer, True)
            self.taps = layers


class LlamaCppBackend:
    """A GGUF target's passes in libllama (see the module docstring)."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, n_layers: int, dim: int, vocab: int, threads: int | None = None,
                 binding: Binding | None = None) -> None:
        self.binding = binding or load()
        api = self.binding.api
        params = api.llama_model_default_params()
        self.model = api.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise BackendUnsupported(f"{gguf.name}: llama.cpp could not load this GGUF (an architecture it lacks?)")
        weakref.finalize(self, api.llama_model_free, self.model)
        self.gguf = gguf
        self.threads = threads or torch.get_num_threads()
        self.n_layers, self.dim, self.vocab = n_layers, dim, vocab
        theirs = (api.llama_model_n_layer(self.model), api.llama_model_n_embd(self.model),
                  api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model)))
        if theirs != (n_layers, dim, vocab):
            raise BackendUnsupported(f"{gguf.name}: llama.cpp reads {theirs[0]} layers, width {theirs[1]}, "
                                     f"{theirs[2]} tokens; the Hugging Face config says {n_layers}, {dim}, {vocab}")

    def check_taps(self, taps: Collection[int]) -> None:
        """Refuse taps llama.cpp cannot extract (the last layer's output)."""
        bad = [i for i in taps if not 0 <= i < self.n_layers - 1]
        if bad:
            raise BackendUnsupported(f"target.backend=llama.cpp extracts the outputs of layers 0..{self.n_layers - 2} "
                                     f"(each as the next layer's input); the drafter taps layer {bad[0]}: use "
                                     "target.backend=torch")

    def new_cache(self, slots: int, capacity: int) -> LlamaCppCache:
        return LlamaCppCache(self, slots, capacity)

    def forward(self, batch: VarlenBatch, cache: LlamaCppCache, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput:
        if batch.tree is not None:
            raise BackendUnsupported("the llama.cpp backend verifies chains, not token trees: use "
                                     "target.backend=torch for tree verification")
        self.check_taps(taps)
        api, n = self.binding.api, batch.num_tokens
        starts, ends = batch.start_pos.tolist(), (batch.start_pos + batch.cu_seqlens.diff()).tolist()
        cache.prepare(batch.slots.tolist(), starts, ends)
        cache.note_written(batch.slots.tolist(), ends)
        cache.extract(frozenset(i + 1 for i in taps))
        outputs = np.zeros(n, dtype=np.int8)
        inverse = None
        if logits_rows is not None:
            distinct, inverse = torch.unique(logits_rows, return_inverse=True)  # sorted: batch order
            outputs[distinct.numpy()] = 1
        tokens, positions = batch.tokens.numpy(), batch.positions.numpy()
        token_slots = batch.token_slots.numpy()
        logits, tapped = [], {i: [] for i in taps}
        for lo in range(0, n, PASS_TOKENS):
            hi = min(n, lo + PASS_TOKENS)
            n_out = cache.batch.fill(tokens[lo:hi], positions[lo:hi], token_slots[lo:hi], outputs[lo:hi])
            status = api.llama_decode(cache.ctx, cache.batch.struct)
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status} on a pass of {hi - lo} tokens")
            if n_out:
                logits.append(_floats(api.llama_get_logits(cache.ctx), n_out, self.vocab))
            for i in taps:
                tapped[i].append(_floats(self.binding.get_layer_inp(cache.ctx, i + 1), hi - lo, self.dim))
        out_logits = None
        if logits_rows is not None:
            out_logits = torch.cat(logits) if len(logits) > 1 else logits[0]
            out_logits = out_logits if len(inverse) == len(out_logits) and bool((inverse.diff() == 1).all()) \
                else out_logits[inverse]
        return ForwardOutput(out_logits, None, {i: torch.cat(t) if len(t) > 1 else t[0] for i, t in tapped.items()})


def _floats(pointer: Any, rows: int, width: int) -> Tensor:
    """A copy of ``rows × width`` floats at a C pointer (llama.cpp reuses its buffers next pass)."""
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_float * (rows * width)).from_address(address))
                            .reshape(rows, width).copy())
