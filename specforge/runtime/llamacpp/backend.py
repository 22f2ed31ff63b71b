"""The llama.cpp target backend: the engine's passes run in libllama on the GGUF file itself.

One engine pass is one ``llama_decode`` over every active request: request r is sequence id
``slot_r``, its new tokens carry their absolute positions, and only the rows the engine asks
logits for are outputs.  The KV cache is llama.cpp's, one *unified* buffer for all sequences:
the engine's runs have different lengths (one decoding token beside a 5-token verification beside
a 128-token prefill chunk), and with per-sequence buffers llama.cpp splits such a batch into
equal-length micro-batches — one pass would become many.  Rolling back after a rejection costs
nothing at crop time: the next pass of that slot first removes its entries from the write position
on (``llama_memory_seq_rm``), as the torch cache overwrites them.

A token tree (a tree pass) maps onto llama.cpp's sequences: each leaf's path gets a branch
sequence id of its own that shares the request's prefix (``llama_memory_seq_cp``), a node belongs
to the branches of every leaf below it and sits at position start + depth, so it attends to the
prefix and its own ancestors only; after verification the accepted path joins the request's
sequence and the branches are dropped (:meth:`LlamaCppCache.compact`).

Taps come from llama.cpp's layer-input extraction: the input of layer i + 1 is the residual stream
after layer i, for every token of the pass.  The output of the last layer has no such input, so a
drafter tapping it (Medusa) cannot run here — :meth:`LlamaCppBackend.lacks` says so.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specforge.errors import SpecforgeError
from specforge.runtime.llamacpp.libllama import Binding, load
from specforge.passes import VarlenBatch
from specforge.runtime.contract import CacheFullError, ForwardOutput, Needs, SlotTable

__all__ = ["BackendUnsupported", "LlamaCppBackend", "LlamaCppCache"]

# Tokens per llama_decode: one micro-batch (n_ubatch = n_batch), so a pass's layer inputs come
# back in the batch's own order.  A bigger pass is cut into several decodes, in order.
PASS_TOKENS = 512
LLAMA_MAX_SEQ = 256  # llama.cpp's bound on sequence ids (src/llama-cparams.h)
# KV cells of one context at most.  The engine sizes a cache for every slot at its full context
# (64 slots × 4,096 positions would be 6 GB of float16 K/V for SmolLM2, allocated up front); the
# unified cache needs cells only for the tokens actually in flight, and a pass that finds none
# free is a CacheFullError naming this bound.
MAX_CELLS = 1 << 17
BRANCHES_PER_SLOT = 8  # sequence ids a slot's token trees may use at once beyond its own


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
        self.tree_ids = np.zeros(0, dtype=np.int32)  # a tree pass's id lists, alive while it runs
        self.seq_id = np.zeros(capacity, dtype=np.uint64)
        self.struct = api.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self.seq_id.ctypes.data, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, outputs: np.ndarray,
             sequences: list[list[int]] | None = None) -> int:
        """One decode's tokens; ``sequences[i]``: token i's sequence ids (a tree pass), else its slot."""
        n = len(tokens)
        self.token[:n], self.pos[:n], self.logits[:n] = tokens, positions, outputs
        if sequences is None:
            self.seq_id[:n], self.n_seq_id[:n] = self.id_ptr[slots], 1
        else:
            counts = np.array([len(ids) for ids in sequences], dtype=np.int32)
            self.tree_ids = np.array([i for ids in sequences for i in ids], dtype=np.int32)
            offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.uint64)
            self.seq_id[:n], self.n_seq_id[:n] = self.tree_ids.ctypes.data + 4 * offsets, counts
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
        self.cells = min(slots * capacity, MAX_CELLS)
        params.n_ctx = self.cells
        params.n_batch = params.n_ubatch = PASS_TOKENS
        params.n_seq_max = min(LLAMA_MAX_SEQ, slots * (1 + BRANCHES_PER_SLOT))
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
        self.spare = list(range(params.n_seq_max - 1, slots - 1, -1))  # branch sequence ids not in use
        self.branch: dict[int, list[int]] = {}  # slot -> the branch id each node of its last tree joins
        self.held: dict[int, tuple[int, list[int]]] = {}  # slot -> prompt tokens not decoded yet (start, ids)

    def hold(self, slot: int, start: int, tokens: list[int]) -> None:
        """Keep prompt tokens at ``start, …`` of ``slot`` for its next pass (:meth:`LlamaCppBackend.forward`)."""
        if slot in self.held:
            held_start, held = self.held[slot]
            if held_start + len(held) != start:
                raise ValueError(f"slot {slot}: held tokens end at {held_start + len(held)}, the next start at {start}")
            held.extend(tokens)
        else:
            self.held[slot] = (start, list(tokens))

    def release(self, slot: int, start: int) -> tuple[int, list[int]]:
        """``(start, tokens)`` held for ``slot`` ahead of a run at ``start`` (nothing: ``(start, [])``)."""
        if slot not in self.held:
            return start, []
        held_start, held = self.held.pop(slot)
        if held_start + len(held) != start:
            raise ValueError(f"slot {slot}: held tokens end at {held_start + len(held)}, its run starts at {start}")
        return held_start, held

    def free(self, slot: int) -> None:
        super().free(slot)
        self.held.pop(slot, None)
        self._drop_branches(slot)
        if self.kv_end[slot]:
            self.api.llama_memory_seq_rm(self.memory, slot, -1, -1)
            self.kv_end[slot] = 0

    def _drop_branches(self, slot: int) -> None:
        for seq in sorted(set(self.branch.pop(slot, ())), reverse=True):
            self.api.llama_memory_seq_rm(self.memory, seq, -1, -1)
            self.spare.append(seq)

    def branches(self, slot: int, start: int, bits: list[int]) -> list[list[int]]:
        """Sequence ids of a tree run's nodes (``bits[j]``: node j's ancestors-or-self, one bit a
        node): one branch per leaf, sharing ``slot``'s first ``start`` positions."""
        leaves = [j for j in range(len(bits)) if not any(bits[k] >> j & 1 for k in range(len(bits)) if k != j)]
        if len(leaves) > len(self.spare):
            raise BackendUnsupported(f"a token tree of {len(leaves)} leaves needs more llama.cpp sequences than are "
                                     f"free ({len(self.spare)}); use target.backend=torch for trees this wide")
        ids = [self.spare.pop() for _ in leaves]
        for seq in ids:
            self.api.llama_memory_seq_cp(self.memory, slot, seq, 0, start)
        per_node = [[seq for seq, leaf in zip(ids, leaves) if bits[leaf] >> j & 1] for j in range(len(bits))]
        self.branch[slot] = [nodes[0] for nodes in per_node]
        return per_node

    def compact(self, slot: int, keep: list[int], start: int) -> None:
        """The accepted path (``keep``: its nodes' run positions) joins ``slot`` at ``start, start +
        1, …`` — where llama.cpp already holds them (a node sits at start + depth) — and every
        branch of the tree is dropped."""
        if slot not in self.branch:
            if keep != list(range(start, start + len(keep))):
                raise ValueError(f"slot {slot}: no tree pass to compact")
            return
        seq = self.branch[slot][keep[-1] - start]
        self.api.llama_memory_seq_cp(self.memory, seq, slot, start, start + len(keep))
        self._drop_branches(slot)
        self.kv_end[slot] = start + len(keep)

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

    def lacks(self, needs: Needs) -> str | None:
        """llama.cpp extracts a layer's output as the next layer's input, so not the last layer's;
        and it returns logits, not every row's final hidden state."""
        bad = [i for i in needs.taps if not 0 <= i < self.n_layers - 1]
        if bad:
            return (f"llama.cpp extracts the outputs of layers 0..{self.n_layers - 2} (each as the next layer's "
                    f"input); the drafter taps layer {bad[0]}")
        if needs.final_hidden:
            return "llama.cpp returns logits, not every row's final hidden state"
        return None

    def new_cache(self, slots: int, capacity: int) -> LlamaCppCache:
        return LlamaCppCache(self, slots, capacity)

    def cache_bytes(self, slots: int, capacity: int) -> int:
        """llama.cpp allocates its context's cells up front: K and V in float16 (its default type)
        for every layer, at most :data:`MAX_CELLS` of them."""
        api = self.binding.api
        kv_width = api.llama_model_n_head_kv(self.model) * (self.dim // api.llama_model_n_head(self.model))
        return min(slots * capacity, MAX_CELLS) * self.n_layers * 2 * kv_width * 2

    def forward(self, batch: VarlenBatch, cache: LlamaCppCache, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput:
        """One engine pass.  A pass of prompt tokens alone (no logits, no taps) is held, not
        decoded: its tokens lead the slot's next pass, so a prompt reaches llama.cpp whole with the
        token whose logits come first — the pass shapes llama.cpp's own decoding runs, whose
        Q8_1-rounded results depend on them (see :func:`_merge_held`)."""
        why = self.lacks(Needs(tuple(taps)))
        if why:
            raise BackendUnsupported(f"target.backend=llama.cpp: {why}; use target.backend=torch")
        if logits_rows is None and not taps and batch.tree is None:
            for slot, start, lo, hi in zip(batch.slots.tolist(), batch.start_pos.tolist(),
                                           batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
                cache.hold(slot, start, batch.tokens[lo:hi].tolist())
            return ForwardOutput(None, None, {})
        if not cache.held:
            return self._decode(batch, cache, logits_rows, taps)
        merged, rows = _merge_held(batch, cache)
        out = self._decode(merged, cache, None if logits_rows is None else rows[logits_rows], taps)
        return ForwardOutput(out.logits, None, {i: t[rows] for i, t in out.taps.items()})

    def _decode(self, batch: VarlenBatch, cache: LlamaCppCache, logits_rows: Tensor | None,
                taps: tuple[int, ...]) -> ForwardOutput:
        api, n = self.binding.api, batch.num_tokens
        slots = batch.slots.tolist()
        starts, ends = batch.start_pos.tolist(), (batch.start_pos + batch.cu_seqlens.diff()).tolist()
        cache.prepare(slots, starts, ends)
        cache.note_written(slots, ends)
        sequences = None
        if batch.tree is not None:
            if n > PASS_TOKENS:
                raise BackendUnsupported(f"a tree pass of {n} tokens exceeds one llama.cpp decode ({PASS_TOKENS})")
            bits, cu = batch.tree.tolist(), batch.cu_seqlens.tolist()
            sequences = [ids for r, slot in enumerate(slots)
                         for ids in cache.branches(slot, starts[r], [b & (2**64 - 1) for b in bits[cu[r]:cu[r + 1]]])]
        cache.extract(frozenset(i + 1 for i in taps))
        outputs = np.zeros(n, dtype=np.int8)
        inverse = None
        if logits_rows is not None:
            distinct, inverse = torch.unique(logits_rows, return_inverse=True)  # sorted: batch order
            outputs[distinct.numpy()] = 1
        tokens = batch.tokens.numpy()
        positions = (batch.positions if batch.rope_positions is None else batch.rope_positions).numpy()
        token_slots = batch.token_slots.numpy()
        logits, tapped = [], {i: [] for i in taps}
        for lo in range(0, n, PASS_TOKENS):
            hi = min(n, lo + PASS_TOKENS)
            n_out = cache.batch.fill(tokens[lo:hi], positions[lo:hi], token_slots[lo:hi], outputs[lo:hi], sequences)
            status = api.llama_decode(cache.ctx, cache.batch.struct)
            if status == 1:
                raise CacheFullError(f"llama.cpp's KV cache is full ({cache.cells} cells for every request's "
                                     f"tokens; at most {MAX_CELLS}): fewer requests at once (engine.max_batch) or "
                                     "shorter contexts")
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


def _merge_held(batch: VarlenBatch, cache: LlamaCppCache) -> tuple[VarlenBatch, Tensor]:
    """``batch`` with each slot's held prompt tokens in front of its run, and where each of the
    batch's rows now sits."""
    runs, starts, rows = [], [], []
    cu, slots = batch.cu_seqlens.tolist(), batch.slots.tolist()
    at = 0
    for r, (slot, start) in enumerate(zip(slots, batch.start_pos.tolist())):
        tokens = batch.tokens[cu[r]:cu[r + 1]].tolist()
        held_start, held = cache.release(slot, start)
        runs.append(held + tokens)
        starts.append(held_start)
        rows.extend(range(at + len(held), at + len(held) + len(tokens)))
        at += len(held) + len(tokens)
    parents = None
    if batch.tree is not None:
        raise BackendUnsupported("a tree pass after a held prompt chunk")  # the engine prefills before trees
    return VarlenBatch.build(runs, slots, starts, parents=parents), torch.tensor(rows, dtype=torch.long)


def _floats(pointer: Any, rows: int, width: int) -> Tensor:
    """A copy of ``rows × width`` floats at a C pointer (llama.cpp reuses its buffers next pass)."""
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_float * (rows * width)).from_address(address))
                            .reshape(rows, width).copy())
