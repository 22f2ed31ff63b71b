"""The feature cache's on-disk description: manifest dataclasses, errors, fingerprint, size estimate.

A cache is a directory::

    manifest.json                  CacheManifest (below), rewritten atomically after each shard
    shard-00000.safetensors        one chunk of sequences, complete or absent, never partial
    shard-00001.safetensors
    ...

Each shard holds, for its ``S`` sequences of ``T`` tokens in total (sequences back to back):

    input_ids  [T]        int32   token ids
    loss_mask  [T]        uint8   1 on tokens the drafter is trained to predict (assistant tokens)
    lengths    [S]        int32   tokens per sequence (offsets are its cumulative sum)
    taps       [T, m, d]  feature dtype   outputs of the m tapped target layers (``layer_ids`` order)
    hidden     [T, d]     feature dtype   the target's last hidden state (after its final norm)

and, in the safetensors metadata (key ``specforge_features``, one JSON string), its format
version, index, inputs hash and the target fingerprint, so a stray shard can be identified without
the manifest.  Logits are never stored: ``hidden`` through the frozen LM head gives them back
wherever a loss needs them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.errors import SpecforgeError
from specforge.resume import UnreadableRecord, read_record, refuse_other_settings, write_record
from specforge.runtime.target import dtype_name

__all__ = [
    "FORMAT_VERSION",
    "CacheIntegrityError",
    "CacheManifest",
    "CacheMismatchError",
    "FeatureCacheError",
    "LayerRangeError",
    "ShardInfo",
    "check_layer_ids",
    "default_layer_ids",
    "dtype_from_name",
    "dtype_name",
    "estimate_size",
    "target_fingerprint",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ID_DTYPE = torch.int32  # vocabularies reach ~256k ids: int16 is too small, int64 twice too big
MASK_DTYPE = torch.uint8

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FeatureCacheError(SpecforgeError, ValueError):
    """Base of every feature-cache error; the message alone says what is wrong and where."""


class CacheIntegrityError(FeatureCacheError):
    """A shard or the manifest is missing, truncated or corrupt."""


class CacheMismatchError(FeatureCacheError):
    """The cache on disk was made by another target, from other inputs or with other settings."""


class LayerRangeError(FeatureCacheError):
    """Tapped layer ids outside the target's depth."""


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise FeatureCacheError(f"unsupported feature dtype {name!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class ShardInfo:
    file: str
    first_sequence: int  # index of the shard's first sequence in the whole cache
    num_sequences: int
    num_tokens: int
    inputs_sha256: str  # hash of the ids and masks the shard is computed from
    sha256: str | None = None  # of the file; None until the shard is complete
    num_bytes: int | None = None

    @property
    def complete(self) -> bool:
        return self.sha256 is not None


@dataclass
class CacheManifest:
    target_name: str
    target_fingerprint: str
    target_args: dict[str, Any]
    num_target_layers: int
    layer_ids: list[int]
    hidden_size: int
    feature_dtype: str  # dtype of taps and hidden
    compute_dtype: str  # dtype the target ran in (features differ slightly between dtypes)
    sequences_per_shard: int
    num_sequences: int
    num_tokens: int
    shards: list[ShardInfo] = field(default_factory=list)
    id_dtype: str = dtype_name(ID_DTYPE)
    mask_dtype: str = dtype_name(MASK_DTYPE)
    format_version: int = FORMAT_VERSION

    def save(self, directory: Path) -> None:
        """Replace the manifest in ``directory`` (the one file of a cache that is rewritten)."""
        write_record(directory / MANIFEST, asdict(self), indent=1)

    @classmethod
    def load(cls, directory: Path) -> CacheManifest:
        """The manifest of the cache in ``directory``."""
        path = directory / MANIFEST
        try:
            raw = read_record(path)
        except UnreadableRecord as exc:
            raise CacheIntegrityError(str(exc)) from None
        if raw is None:
            raise CacheIntegrityError(f"{directory} holds no {MANIFEST}: it is not a feature cache")
        if raw.get("format_version") != FORMAT_VERSION:
            raise CacheMismatchError(
                f"feature cache format version {raw.get('format_version')!r}; this specforge reads "
                f"version {FORMAT_VERSION}"
            )
        try:
            raw["shards"] = [ShardInfo(**s) for s in raw.get("shards", [])]
            return cls(**raw)
        except TypeError as exc:  # a key missing or unknown
            raise CacheIntegrityError(f"{path} is unreadable ({exc})") from None

    def check_resumes(self, on_disk: CacheManifest, directory: Path) -> None:
        """Refuse to continue ``on_disk`` (the manifest in ``directory``) as this planned cache
        unless everything but progress agrees: the same target (by fingerprint: the same weights
        under another name make the same features), inputs, layers, dtypes and sharding."""
        def settings(manifest: CacheManifest) -> dict[str, Any]:
            out = asdict(manifest)
            del out["target_name"], out["target_args"]
            out["shards"] = [(s["file"], s["first_sequence"], s["num_sequences"], s["inputs_sha256"])
                             for s in out["shards"]]
            return out

        refuse_other_settings(settings(on_disk), settings(self), subject=f"feature cache {directory}",
                              remedy="resume with the same ones or use a new directory", error=CacheMismatchError,
                              summaries={"shards": "computed from other sequences"})


def check_layer_ids(layer_ids: Sequence[int], n_layers: int) -> list[int]:
    """Validate tapped layer ids (0-based: id i is the residual stream after layer i)."""
    ids = [int(i) for i in layer_ids]
    valid = f"valid ids are 0..{n_layers - 1}"
    if not ids:
        raise LayerRangeError(f"no layer ids to tap; the target has {n_layers} layers ({valid})")
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad:
        raise LayerRangeError(
            f"layer ids {bad} are beyond the target's depth: it has {n_layers} layers ({valid})"
        )
    if len(set(ids)) != len(ids):
        raise LayerRangeError(f"layer ids {ids} repeat a layer; each layer can be tapped once")
    return ids


def default_layer_ids(n_layers: int, m: int = 5) -> list[int]:
    """The default taps: m layers spread evenly from layer 1 to L−3 (fewer on shallow targets).

    See docs/design/drafters.md#context-fusion-and-kv-injection.
    """
    lo, hi = min(1, n_layers - 1), max(min(1, n_layers - 1), n_layers - 3)
    if m <= 1:
        return [hi]
    return sorted({round(lo + (hi - lo) * k / (m - 1)) for k in range(m)})


def _tensor_digest(t: torch.Tensor) -> str:
    # float32 on the host, contiguous: the digest of the weights, whatever dtype the runtime uses.
    data = t.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def target_fingerprint(target: Any) -> str:
    """A short hash that identifies the target's architecture and weights.

    Hashing every weight of a large model on each start would be slow, so the fingerprint covers
    the architecture arguments, the name/shape of every parameter, and the full contents of three
    of them (the first, a middle and the last, in the checkpoint's order): a different checkpoint
    of the same architecture differs in all three.
    """
    model = getattr(target, "hf_model", None) or target.runtime
    h = hashlib.sha256(json.dumps(asdict(target.args), sort_keys=True).encode())
    params = list(model.named_parameters())
    for name, p in params:
        h.update(f"{name}:{tuple(p.shape)};".encode())
    for idx in sorted({0, len(params) // 2, len(params) - 1}):
        name, p = params[idx]
        h.update(f"{name}={_tensor_digest(p)};".encode())
    return h.hexdigest()[:16]


def estimate_size(num_tokens: int, layers: int | Sequence[int], hidden: int,
                  dtype: torch.dtype | str = torch.bfloat16, num_sequences: int = 0) -> int:
    """Bytes of tensor data a cache of ``num_tokens`` tokens takes (each shard adds a JSON header
    of a few hundred bytes on top).  ``layers`` is the number of tapped layers or their ids."""
    m = layers if isinstance(layers, int) else len(layers)
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    feat = dtype.itemsize
    per_token = ID_DTYPE.itemsize + MASK_DTYPE.itemsize + (m + 1) * hidden * feat
    return num_tokens * per_token + num_sequences * ID_DTYPE.itemsize


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
