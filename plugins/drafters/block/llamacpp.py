"""``dspark`` and ``dflash`` drafters as the GGUF file llama.cpp runs them from (``specforge export
--to llama.cpp``; docs/llama-cpp.md).

llama.cpp reads DSpark and DFlash drafters as one architecture, ``dflash`` (``src/models/dflash.cpp``),
converted by ``convert_hf_to_gguf.py`` (``DSparkModel`` / ``DFlashModel`` in ``conversion/qwen.py``)
from the Hugging Face layout vLLM serves — the layout :class:`~specforge_plugins.drafters.block.formats.
BlockFormat` writes for ``--to vllm``.  This export starts from that same layout (its tensors, its
config and every refusal of its) and writes, with the ``gguf`` package, what the converter writes
for it (checked against the llama.cpp vendored by llama-cpp-python 0.3.36):

* *Names.*  ``layers.{i}.*`` → ``blk.{i}.*`` (``attn_norm``, ``attn_q``/``attn_k``/``attn_v``,
  ``attn_output``, ``attn_q_norm``/``attn_k_norm``, ``ffn_norm``, ``ffn_gate``/``ffn_up``/``ffn_down``);
  ``fc`` → ``fc``, ``hidden_norm`` → ``enc.output_norm``, ``norm`` → ``output_norm``,
  ``embed_tokens`` → ``token_embd``, ``lm_head`` → ``output``, ``markov_head.markov_w{1,2}`` →
  ``markov_w{1,2}``, ``confidence_head.proj`` → ``conf_proj``; ``t2d`` dropped (unused at run time).
  Arrays keep their PyTorch shape (GGUF lists dimensions innermost first, which is what llama.cpp's
  loader asks for).  Tensors of one dimension and norms are F32, the rest in the checkpoint's dtype.
* *Metadata.*  ``general.architecture = dflash``; the target's sizes, RoPE base, norm epsilon and
  context length (``dflash.*``, as the converter's base class writes them); ``dflash.block_size``
  (γ for DSpark, γ + 1 for DFlash); ``dflash.target_layers`` = our tapped layers **+ 1** — llama.cpp
  extracts the *input* of those layers (``llama_set_embeddings_layer_inp``), the input of layer
  i + 1 being the output of layer i that we tap (SPEC §12); for DSpark ``dflash.sample_from_anchor``
  (true: the anchor slot is the first prediction) and ``dflash.has_confidence_head``; the target's
  tokenizer (``tokenizer.*``, copied from the target's GGUF, which llama.cpp checks the draft's
  against) with ``tokenizer.ggml.mask_token_id``.
* *Draft vocabulary.*  ``output`` holds the N rows, ``d2t`` the target id of each draft id
  (absolute I64 ids, the converter's ``d2t + arange``); ``markov_w1`` covers the target's ids,
  ``markov_w2`` the draft's.  llama.cpp puts −∞ outside the draft vocabulary, as ours does.
* *The learned MASK vector* is, as in vLLM's layout, row V of a draft ``token_embd`` of V + 1 rows
  (``mask_token_id`` = V); the draft's vocabulary then has one token more than the target's,
  ``[PAD{V}]`` (unused) — the converter pads the tokenizer to the config's ``vocab_size`` the same
  way, and llama.cpp accepts drafts whose vocabulary differs by up to 128 tokens.  Its logits must
  not cover row V, so a drafter over the whole vocabulary gets the identity ``d2t`` and the
  target's LM head as ``output`` (the converter would refuse vLLM's folder, which has neither).
* *Confidence head.*  llama.cpp's always reads ``[h_k; markov_w1[x_k−1]]``; one that reads h_k
  alone gets zero columns for the Markov part (the same function).

Refused, with one sentence and nothing written: what llama.cpp cannot compute exactly — a drafter
without q/k norm (its DFlash graph requires ``attn_q_norm``/``attn_k_norm``), a gated or rnn Markov
head (only the vanilla one is built), a DFlash drafter with a correction or confidence head, a tap
of the target's last layer (its input-of-layer-L does not exist), a target whose RoPE is scaled, a
target that is not a GGUF (llama.cpp runs the target from one, and the draft's tokenizer is copied
from it) or whose GGUF is another model; plus everything vLLM's layout refuses.  Our draft layers
have no sliding window, no attention sinks and no causal mask, so none is ever written.

Not a weight but worth knowing: llama.cpp's in-graph Markov chain conditions position k on the
arg-max of position k − 1 (a TODO in ``build_dspark_markov_head``), ours on the token sampled, so
at T > 0 the two draft different tokens from the same weights (llama.cpp still verifies exactly);
at T = 0 they are the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from specforge.toolkit.checkpoints import TARGET_SHAPE
from specforge.toolkit.formats import InteropError, recorded_gguf, recorded_target, rope_theta, target_tensor
from specforge.toolkit.heads import HEADS
from specforge_plugins.drafters.block.checkpoint import load_drafter

if TYPE_CHECKING:
    from specforge_plugins.drafters.block.formats import BlockFormat

__all__ = ["ARCH", "LlamaCppFormat", "gguf_name", "read_metadata"]

#: llama.cpp's architecture for DSpark and DFlash drafters, and the keys and tensor names its
#: converter writes (``gguf-py/gguf/constants.py`` of the vendored llama.cpp; the ``gguf`` package on
#: PyPI predates them, so they are spelled out here).
ARCH = "dflash"
KEY_BLOCK_SIZE, KEY_TARGET_LAYERS = f"{ARCH}.block_size", f"{ARCH}.target_layers"
KEY_SAMPLE_FROM_ANCHOR, KEY_HAS_CONFIDENCE = f"{ARCH}.sample_from_anchor", f"{ARCH}.has_confidence_head"
KEY_MASK = "tokenizer.ggml.mask_token_id"
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}
_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
        "embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
        "markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
        "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias",
        "d2t": "d2t"}
_UNUSED_TOKEN = 5  # gguf.TokenType.UNUSED: the converter's type for the [PAD{i}] tokens it appends


def gguf_name(name: str) -> str | None:
    """The GGUF name llama.cpp's converter gives the vLLM-layout tensor ``name`` (None: not written)."""
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"blk.{i}.{_LAYER[rest]}" if rest in _LAYER else None
    return _TOP.get(name)


class LlamaCppFormat:
    """``--to llama.cpp``: the drafter as one GGUF file (a layout that is a file, not a folder:
    :attr:`suffix`); export only — a GGUF is not imported."""

    name = "llama.cpp"
    suffix = ".gguf"

    def __init__(self, vllm: BlockFormat) -> None:
        self.vllm, self.method = vllm, vllm.method
        kind = "DSpark" if self.method == "dspark" else "DFlash"
        self.title = f"llama.cpp's {kind} draft (GGUF, architecture {ARCH})"
        self.description = (f"{self.title}: one .gguf file for llama-speculative-simple / llama-server "
                            f"--spec-type draft-{self.method}")

    # -- export ---------------------------------------------------------------------------------

    def export(self, source: Path, out: Path) -> list[str]:
        """Write the GGUF file ``out`` (refusals first; nothing is written on error)."""
        import gguf

        backbone, head, conf, _ = load_drafter(source)
        c = backbone.config
        self._refuse(c, head, conf, source)
        config, tensors, _ = self.vllm.layout(source, title=self.title)
        target_gguf = self._target_gguf(config, source)
        fields = read_metadata(target_gguf)
        self._check_target(fields, c, target_gguf, source)
        notes = [f"the tokenizer, sizes and RoPE base: the target's ({target_gguf})"]

        v, d = c.vocab_size, c.dim
        v_in = int(config["vocab_size"])  # V, or V + 1 with the learned MASK vector as row V
        taps = (config.get("dflash_config") or {}).get("target_layer_ids") or config["target_layer_ids"]
        mask = int((config.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id")))
        tensors = dict(tensors)
        tensors.pop("t2d", None)
        if "d2t" in tensors:  # offsets → the absolute target ids llama.cpp reads
            tensors["d2t"] = tensors["d2t"].long() + torch.arange(len(tensors["d2t"]))
        elif v_in > v:  # logits over V ids only, while the draft's own vocabulary has V + 1 tokens
            tensors["d2t"] = torch.arange(v)
            _, target_dir, _ = recorded_target(config["specforge"]["target"], c, TARGET_SHAPE, source)
            tensors["lm_head.weight"] = target_tensor(target_dir, "lm_head.weight", "model.embed_tokens.weight",
                                                      "embed_tokens.weight").to(tensors["fc.weight"].dtype)
            notes.append(f"the target's LM head as output and an identity d2t: the draft's vocabulary has {v_in} "
                         f"tokens (the learned MASK vector is token {v}, [PAD{v}]) and its logits cover the "
                         f"target's {v}")
        if v_in > v:
            notes.append(f"the learned MASK vector is token_embd row {v} (mask_token_id {v}); the other rows are "
                         "the target's embedding")
        w = tensors.get("confidence_head.proj.weight")
        rank = tensors["markov_head.markov_w1.weight"].shape[1] if "markov_head.markov_w1.weight" in tensors else 0
        if w is not None and w.shape[1] == d:  # it reads h_k alone: zero weight on markov_w1[x]
            tensors["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, rank)], dim=1)
            notes.append("the confidence head reads h_k alone: written with zero weights on markov_w1[x]")
        if self.method == "dspark" and head is None:
            notes.append("no correction head: a rank-1 Markov head of zeros (a zero bias), as vLLM's layout writes it")

        dtype = tensors["fc.weight"].dtype
        ftype = {torch.float32: gguf.LlamaFileType.ALL_F32, torch.float16: gguf.LlamaFileType.MOSTLY_F16,
                 torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16}.get(dtype)
        if ftype is None:
            raise InteropError(f"{source}: weights in {dtype}; a GGUF drafter holds float32, float16 or bfloat16")
        writer = gguf.GGUFWriter(str(out), ARCH)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(f"{source.name} ({self.method} drafter for {config['specforge']['target']})")
        writer.add_block_count(int(config["num_hidden_layers"]))
        if config.get("max_position_embeddings") is not None:
            writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(d)
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(int(config["num_attention_heads"]))
        writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
        writer.add_rope_freq_base(float(rope_theta(config) or c.rope_theta))
        writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
        if config.get("head_dim") is not None or c.head_dim * c.n_heads != d:
            writer.add_key_length(c.head_dim)
            writer.add_value_length(c.head_dim)
        writer.add_file_type(ftype)
        writer.add_uint32(KEY_BLOCK_SIZE, int(config["block_size"]))
        writer.add_array(KEY_TARGET_LAYERS, [int(i) + 1 for i in taps])  # layer inputs: our outputs + 1
        if self.method == "dspark":
            writer.add_bool(KEY_SAMPLE_FROM_ANCHOR, True)
            writer.add_bool(KEY_HAS_CONFIDENCE, "confidence_head.proj.weight" in tensors)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _copy_tokenizer(fields, writer, v_in)
        writer.add_uint32(KEY_MASK, mask)

        for key, tensor in tensors.items():
            name = gguf_name(key)
            if name is None:
                raise InteropError(f"{source}: no GGUF name for the tensor {key!r}")  # a layout this module lacks
            _add_tensor(writer, name, tensor, ftype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return notes

    def _refuse(self, c: Any, head: Any, conf: Any, source: Path) -> None:
        """One sentence for the first thing llama.cpp cannot compute exactly (the module docstring)."""
        kind = None if head is None else next((k for k, cls in HEADS.items() if type(head) is cls), "?")
        checks = [
            (not c.qk_norm, f"{self.title} requires every draft layer's attn_q_norm/attn_k_norm (Qwen3's per-head "
                            "q/k RMSNorm) and this drafter has no qk-norm (trained with drafter.qk_norm=false, or "
                            "before it was the default); an RMSNorm is not the identity — retrain with "
                            "drafter.qk_norm=true (the default)"),
            (self.method == "dspark" and kind not in (None, "markov"),
             f"{self.title} builds only the vanilla Markov head (markov_w2(markov_w1[x])) and this drafter's "
             f"correction head is {kind} — train with drafter.head.name=markov"),
            (self.method == "dflash" and head is not None,
             f"{self.title} reads a Markov head as DSpark's (anchor-first) and this DFlash drafter has a {kind} one "
             "— train with drafter.head.name=none"),
            (self.method == "dflash" and conf is not None,
             f"{self.title} has no confidence head and this drafter has one — train with "
             "drafter.confidence.name=none"),
            (c.n_target_layers - 1 in c.tap_layers,
             f"it taps the target's last layer ({c.n_target_layers - 1}) and llama.cpp reads the input of the layer "
             f"after each tapped one, which does not exist for it — train with drafter.target_layers below "
             f"{c.n_target_layers - 1}"),
        ]
        for failed, message in checks:
            if failed:
                raise InteropError(f"{source}: {message}")

    def _target_gguf(self, config: dict[str, Any], source: Path) -> Path:
        """The recorded target's GGUF file (llama.cpp runs the target from it)."""
        name = config["specforge"]["target"]
        path = recorded_gguf(name, source)
        if path is None:
            raise InteropError(f"{source}: its target {name!r} is a Hugging Face folder and llama.cpp runs the target, "
                               "and takes the draft's tokenizer, from a GGUF — convert the target with llama.cpp's "
                               "convert_hf_to_gguf.py and train the drafter against that file")
        scaling = config.get("rope_scaling") or {}
        rope_type = (config.get("rope_parameters") or {}).get("rope_type") or scaling.get("rope_type") or "default"
        if scaling or rope_type != "default":
            raise InteropError(f"{source}: its target scales RoPE ({rope_type}); llama.cpp's DFlash graph rotates the "
                               "draft with the plain RoPE of its base, so it cannot be written exactly")
        return path

    def _check_target(self, fields: dict[str, tuple[int, int | None, Any]], c: Any, path: Path,
                      source: Path) -> None:
        def get(key: str) -> Any:
            return fields[key][2] if key in fields else None

        arch = get("general.architecture")
        arch = arch.decode() if isinstance(arch, bytes) else arch
        tokens = get("tokenizer.ggml.tokens")
        found = {"tokens": None if tokens is None else len(tokens), "dim": get(f"{arch}.embedding_length"),
                 "layers": get(f"{arch}.block_count")}
        want = {"tokens": c.vocab_size, "dim": c.dim, "layers": c.n_target_layers}
        wrong = ", ".join(f"{k} {found[k]} (drafter: {want[k]})" for k in want if found[k] != want[k])
        if wrong:
            raise InteropError(f"{source}: its target's GGUF {path} is another model — {wrong}")

    # -- a GGUF is not imported -------------------------------------------------------------------

    def detect(self, directory: Path) -> bool:
        return False  # import reads folders; a GGUF drafter is llama.cpp's, not a layout to import

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]:
        raise InteropError(f"{directory}: a llama.cpp GGUF drafter is not imported; import the Hugging Face folder it "
                           "was converted from (--from vllm)")


# GGUF value types (gguf.GGUFValueType): struct codes of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path) -> dict[str, tuple[int, int | None, Any]]:
    """Every key of a GGUF file's header: ``{key: (type, array item type or None, value)}``, strings
    as bytes (as stored), numeric arrays as lists.  ``gguf.GGUFReader`` reads the same, but builds a
    view per string: ten seconds for a 49k-token vocabulary; this reads the header alone, in well
    under one."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise InteropError(f"{path}: not a GGUF file")
        version, _, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise InteropError(f"{path}: GGUF version {version}; llama.cpp writes 2 and later")
        pos = 24

        def string() -> bytes:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return buf[pos - n:pos]

        def scalar(vtype: int) -> Any:
            nonlocal pos
            fmt = _SCALARS[vtype]
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        out: dict[str, tuple[int, int | None, Any]] = {}
        for _ in range(n_kv):
            key = string().decode("utf-8")
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if vtype == _ARRAY:
                sub, n = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if sub == _STRING:
                    value: Any = [string() for _ in range(n)]
                else:
                    dtype = np.dtype(_SCALARS[sub])
                    value = np.frombuffer(buf, dtype, n, pos).tolist()
                    pos += n * dtype.itemsize
                out[key] = (vtype, sub, value)
            else:
                out[key] = (vtype, None, string() if vtype == _STRING else scalar(vtype))
        return out


def _copy_tokenizer(fields: dict[str, tuple[int, int | None, Any]], writer: Any, n_tokens: int) -> None:
    """The target GGUF's ``tokenizer.*`` fields as they are (string bytes untouched), its token list
    padded to ``n_tokens`` with ``[PAD{i}]`` tokens of the unused type, as the converter pads it."""
    import gguf

    for key, (vtype, sub, value) in fields.items():
        if not key.startswith("tokenizer.") or key == KEY_MASK:
            continue
        if vtype == _ARRAY:
            value = list(value)
            if key == "tokenizer.ggml.tokens":
                value += [f"[PAD{i}]".encode() for i in range(len(value), n_tokens)]
            elif key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores") and len(value) < n_tokens:
                value += [_UNUSED_TOKEN if key.endswith("type") else -1000.0] * (n_tokens - len(value))
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=gguf.GGUFValueType(sub))
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype))


def _add_tensor(writer: Any, name: str, tensor: Tensor, ftype: Any) -> None:
    """One tensor with the converter's type rule: I64 ``d2t``; F32 for one dimension, norms and
    anything not named ``.weight``; the file type's for the rest."""
    import gguf

    if name == "d2t":
        writer.add_tensor(name, tensor.detach().to(torch.int64).numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
        return
    data = tensor.detach().float().contiguous().numpy()
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        qtype = gguf.GGMLQuantizationType.F32
    else:
        qtype = {gguf.LlamaFileType.ALL_F32: gguf.GGMLQuantizationType.F32,
                 gguf.LlamaFileType.MOSTLY_F16: gguf.GGMLQuantizationType.F16,
                 gguf.LlamaFileType.MOSTLY_BF16: gguf.GGMLQuantizationType.BF16}[ftype]
    # bfloat16 comes back as bytes, whose shape the writer turns into the element shape itself
    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
