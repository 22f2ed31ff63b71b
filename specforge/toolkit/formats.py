"""What a checkpoint-format author uses: the :class:`CheckpointFormat` protocol a drafter plug-in
registers (``formats=(...)``), its :class:`InteropError`, and the helpers every layout needs to
read a foreign folder and check it before anything is written (docs/interop.md).

``specforge export`` / ``specforge import`` (:mod:`specforge.interop`) only dispatch to the
formats; the layouts themselves live with their drafter method.

Loading never unpickles: a folder with only PyTorch pickles (``*.bin``, ``*.pt``) is refused,
naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor

from specforge.errors import SpecforgeError

__all__ = ["CheckpointFormat", "InteropError", "check_shapes", "drop_frozen", "load_tensors", "mismatch",
           "read_config", "recorded_gguf", "recorded_target", "require_safetensors", "rope_theta", "target_tensor"]

_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class InteropError(SpecforgeError, ValueError):
    """A checkpoint that cannot be exported or imported; the message names the file and the problem."""


@runtime_checkable
class CheckpointFormat(Protocol):
    """One foreign layout of a drafter method's checkpoints.

    ``name`` is what ``--to``/``--from`` select (``vllm``, ``sglang``…); ``export`` writes the
    layout of the specforge checkpoint ``source`` into the empty folder ``out`` and returns notes
    for the user; ``detect`` says whether a folder is in this layout; ``import_checkpoint`` writes
    a specforge checkpoint of it into the empty folder ``out`` (``target``: a bound target to check
    re-stored frozen weights against, or None) and returns notes.  Both check every required
    tensor's presence and shape first and raise :class:`InteropError` naming the file.
    """

    name: str
    description: str

    def export(self, source: Path, out: Path) -> list[str]: ...

    def detect(self, directory: Path) -> bool: ...

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]: ...


# -- reading a foreign folder --------------------------------------------------------------------


def require_safetensors(directory: Path, weights: str) -> Path:
    """The safetensors file ``weights`` of ``directory``; a folder holding only pickles is refused
    (loading one could run code)."""
    path = directory / weights
    if path.is_file():
        return path
    pickles = sorted(p.name for pattern in _PICKLES for p in directory.glob(pattern))
    if pickles:
        raise InteropError(f"{directory / pickles[0]}: a pickle checkpoint; specforge loads weights only from "
                           f"safetensors (convert it with the project that wrote it, e.g. safetensors' "
                           f"`save_file`, then import the result)")
    raise InteropError(f"{path}: missing (no weights in {directory})")


def read_config(directory: Path, name: str = "config.json") -> dict[str, Any] | None:
    """The JSON object ``directory/name``; None when it is missing, unreadable or not an object
    (``detect`` then says no)."""
    try:
        config = json.loads((Path(directory) / name).read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def load_tensors(directory: Path, weights: str = "model.safetensors") -> tuple[Path, dict[str, Tensor]]:
    """``(file, tensors)``: every tensor of ``directory/weights``, or of the shards its
    ``weights.index.json`` lists (Hugging Face's ``save_pretrained`` splits large models); an
    unreadable file is one error naming it, a pickle-only folder is refused."""
    directory = Path(directory)
    index = directory / f"{weights}.index.json"
    if index.is_file() and not (directory / weights).is_file():
        shards = sorted(set(((read_config(directory, index.name) or {}).get("weight_map") or {}).values()))
        if not shards:
            raise InteropError(f"{index}: no weight_map naming its shards")
        where, paths = index, [directory / shard for shard in shards]
    else:
        where = require_safetensors(directory, weights)
        paths = [where]
    tensors: dict[str, Tensor] = {}
    for path in paths:
        try:
            tensors.update(load_file(str(path)))
        except (OSError, SafetensorError) as exc:
            raise InteropError(f"{path}: not a readable safetensors file ({exc})") from None
    return where, tensors


# -- checking it before anything is written ------------------------------------------------------


def check_shapes(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]], where: Path) -> None:
    """Every ``expected`` tensor present with its shape, before anything is written."""
    for key, want in expected.items():
        if key not in tensors:
            raise InteropError(f"{where}: the tensor {key!r} is missing")
        if tuple(tensors[key].shape) != tuple(want):
            raise InteropError(f"{where}: {key!r} has shape {tuple(tensors[key].shape)}, the config says {tuple(want)}")


def drop_frozen(tensor: Tensor, reference: Tensor | None, key: str, what: str, where: Path) -> str:
    """A re-stored copy of one of the target's frozen tensors (its embedding, its LM head): checked
    equal to the bound target's ``reference`` when there is one, then dropped — the drafter reads
    the target's own.  Compared in the checkpoint's dtype: a drafter trained in bf16 re-stores the
    target's float32 tensor rounded to bf16 (DeepSpec's do).  Returns the note."""
    if reference is not None and not torch.equal(tensor, reference.to(tensor.dtype)):
        raise InteropError(f"{where}: its {key!r} is not the target's {what} (another target?)")
    return (f"dropped {key!r}: the drafter reads the target's own {what}"
            + ("" if reference is None else " (checked equal to the bound target's)"))


def mismatch(pairs: dict[str, tuple[Any, Any]]) -> str:
    """``"dim 32 (target: 64), …"`` for the ``{name: (checkpoint's, target's)}`` that differ; ""
    when all agree."""
    return ", ".join(f"{k} {mine} (target: {theirs})" for k, (mine, theirs) in pairs.items() if mine != theirs)


# -- the target a checkpoint records (layouts that copy its config or its frozen tensors) --------


def rope_theta(config: dict[str, Any]) -> float | None:
    """The RoPE base of an HF ``config.json`` (``rope_parameters`` in newer transformers, else top level)."""
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return None if theta is None else float(theta)


def recorded_target(name: Any, shape: Any, fields: dict[str, str], source: Path) -> tuple[dict[str, Any], Path, Any]:
    """The recorded target's ``config.json``, folder (a GGUF's cached conversion) and
    :class:`~specforge.model_args.ModelArgs`, checked to be the one the drafter was trained for
    (``fields``: the drafter shape's field → the ModelArgs attribute it must equal): layouts that
    copy the target's config, or re-store its embedding, read them from here."""
    # Imported on the call, not with this module: the target package loads the runtime (and with it
    # the pipeline config and the plug-in host), which only an export that copies the target needs;
    # importing the toolkit must never drag them in.
    from transformers import AutoConfig

    from specforge.model_args import ModelArgs
    from specforge.model_files import converted_checkpoint

    if not name:
        raise InteropError(f"{source}: the checkpoint does not record its target, whose config the layout copies")
    try:
        directory = converted_checkpoint(str(name))
        config = json.loads((directory / "config.json").read_text())
        args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    except (SpecforgeError, OSError, ValueError) as exc:
        raise InteropError(f"{source}: its target {name!r} cannot be read ({exc}); the layout copies the target's "
                           "config") from None
    wrong = mismatch({k: (getattr(shape, k), getattr(args, t)) for k, t in fields.items()})
    if wrong:
        raise InteropError(f"{source}: its recorded target {name!r} is another model — {wrong}")
    return config, directory, args


def recorded_gguf(name: Any, source: Path) -> Path | None:
    """The GGUF file of the recorded target ``name`` (an embedded model or a ``.gguf`` path), or None
    when the target is a Hugging Face folder: layouts whose engine runs the target from a GGUF
    (llama.cpp) copy its tokenizer from there."""
    from specforge.model_files import resolve_model

    if not name:
        raise InteropError(f"{source}: the checkpoint does not record its target, whose GGUF the layout reads")
    try:
        directory, filename = resolve_model(str(name))
    except (SpecforgeError, OSError) as exc:
        raise InteropError(f"{source}: its target {name!r} cannot be found ({exc})") from None
    return None if filename is None else directory / filename


def target_tensor(directory: Path, *keys: str) -> Tensor:
    """The first of ``keys`` found in the target's safetensors, read alone (not the whole model)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found = next((k for k in keys if k in f.keys()), None)
            if found is not None:
                return f.get_tensor(found)
    raise InteropError(f"{directory}: none of {', '.join(keys)} in the target's safetensors")
