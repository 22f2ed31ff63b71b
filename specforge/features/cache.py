"""Target features for drafter training (docs/training.md): an offline cache and an online twin.

Both produce the same :class:`SequenceFeatures` per sequence — token ids, loss mask, the outputs of
the tapped target layers and the target's last hidden state — so a trainer takes either.

* :func:`write_feature_cache` runs the target once over tokenised sequences (chunks of sequences
  through the flattened varlen forward, fresh KV cache, no LM head) and writes sharded safetensors
  plus ``manifest.json`` (see :mod:`.manifest` for the format).  It resumes where a killed run
  stopped and never replaces a shard already on disk.
* :class:`FeatureCache` reads it back, checking every shard against the manifest's sha256.
* :class:`~specforge.features.compute.OnlineFeatures` computes the same features inside the
  training step.

Logits are never stored (a vocabulary row per token is 50–100× the size of a hidden state):
:func:`~specforge.features.compute.project_logits` applies the frozen LM head at the sampled
positions only.

Only safetensors is ever parsed (no pickle), so a cache from elsewhere cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from specforge.features.manifest import (
    FORMAT_VERSION,
    ID_DTYPE,
    MANIFEST,
    MASK_DTYPE,
    CacheIntegrityError,
    CacheManifest,
    CacheMismatchError,
    FeatureCacheError,
    ShardInfo,
    check_layer_ids,
    dtype_from_name,
    dtype_name,
    estimate_size,
    format_bytes,
    target_fingerprint,
)
from specforge.features.compute import SequenceFeatures, as_pair, forward_flat, validate_sequences
from specforge.files import remove_leftovers, write_atomic

__all__ = ["FeatureCache", "VerifyReport", "write_feature_cache"]

META_KEY = "specforge_features"  # the shard's safetensors metadata: one JSON string
NOT_WRITTEN = "not written yet (the writer has not finished)"


# -- shard files -------------------------------------------------------------------------------


def _inputs_sha256(pairs: Sequence[tuple[Tensor, Tensor]]) -> str:
    h = hashlib.sha256()
    for ids, mask in pairs:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.to(ID_DTYPE).numpy().tobytes())
        h.update(mask.to(MASK_DTYPE).numpy().tobytes())
    return h.hexdigest()


def _header(data: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor dtypes/shapes/offsets and ``__metadata__``)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise ValueError("header runs past the end of the file")
    return json.loads(data[8 : 8 + n])


def _write_new_file(path: Path, data: bytes) -> None:
    """Write ``path`` atomically, failing rather than replacing a file that is already there."""
    try:
        write_atomic(path, data, overwrite=False)
    except FileExistsError:
        raise CacheIntegrityError(f"{path} appeared while it was being written; left untouched") from None


def _shard_problem(data: bytes | None, info: ShardInfo, manifest: CacheManifest) -> str | None:
    """What is wrong with a shard's bytes, in words, or None when it is intact."""
    if info.sha256 is None:
        return NOT_WRITTEN
    if data is None:
        return "missing"
    if info.num_bytes is not None and len(data) < info.num_bytes:
        return f"truncated ({len(data)} of {info.num_bytes} bytes)"
    if info.num_bytes is not None and len(data) != info.num_bytes:
        return f"of the wrong size ({len(data)} bytes, the manifest says {info.num_bytes})"
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        return f"corrupt (sha256 {digest[:12]}… differs from the manifest's {info.sha256[:12]}…)"
    return _content_problem(data, info, manifest)


def _content_problem(data: bytes, info: ShardInfo, manifest: CacheManifest) -> str | None:
    try:
        meta = json.loads(_header(data).get("__metadata__", {}).get(META_KEY, "{}"))
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        return f"unreadable ({e})"
    if meta.get("inputs_sha256") != info.inputs_sha256:
        return "computed from other sequences than the manifest lists"
    if meta.get("target_fingerprint") != manifest.target_fingerprint:
        return f"made by another target (fingerprint {meta.get('target_fingerprint')})"
    return None


def _load_tensors(data: bytes, info: ShardInfo, manifest: CacheManifest) -> dict[str, Tensor]:
    tensors = st_load(data)
    t, s = info.num_tokens, info.num_sequences
    m, d = len(manifest.layer_ids), manifest.hidden_size
    expected = {"input_ids": (t,), "loss_mask": (t,), "lengths": (s,), "taps": (t, m, d), "hidden": (t, d)}
    for name, shape in expected.items():
        if name not in tensors or tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape) if name in tensors else "absent"
            raise ValueError(f"tensor {name!r} is {got}, expected {shape}")
    return tensors


def _shard_bytes(pairs: Sequence[tuple[Tensor, Tensor]], taps: Tensor, hidden: Tensor, index: int,
                 inputs_sha: str, fingerprint: str) -> bytes:
    tensors = {
        "input_ids": torch.cat([p[0] for p in pairs]).to(ID_DTYPE),
        "loss_mask": torch.cat([p[1] for p in pairs]).to(MASK_DTYPE),
        "lengths": torch.tensor([len(p[0]) for p in pairs], dtype=ID_DTYPE),
        "taps": taps.cpu().contiguous(),
        "hidden": hidden.cpu().contiguous(),
    }
    meta = {"format_version": FORMAT_VERSION, "shard": index, "inputs_sha256": inputs_sha,
            "target_fingerprint": fingerprint}
    # One metadata key holding sorted JSON: safetensors writes several keys in a random order
    # (a Rust HashMap), which would make a recomputed shard differ byte for byte from the original.
    return st_save(tensors, metadata={META_KEY: json.dumps(meta, sort_keys=True)})


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


# -- reading -----------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    num_shards: int
    num_sequences: int
    readable_sequences: int  # sequences in intact shards
    problems: dict[str, str] = field(default_factory=dict)  # shard file -> what is wrong

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_target(manifest: CacheManifest, directory: Path, name: str, fingerprint: str) -> None:
    # The fingerprint decides: the same weights loaded under another name ("smollm2" vs its path)
    # give the same features; the names are in the message to say which two models disagree.
    if manifest.target_fingerprint != fingerprint:
        raise CacheMismatchError(
            f"feature cache {directory} was made by target {manifest.target_name!r} (fingerprint "
            f"{manifest.target_fingerprint}), not by this target {name!r} (fingerprint {fingerprint}); "
            f"use this target's own cache or a new directory"
        )


class FeatureCache:
    """Read side of a feature cache; ``target`` (optional) must be the one that wrote it."""

    def __init__(self, directory: str | Path, target: Any = None) -> None:
        self.directory = Path(directory)
        self.manifest = CacheManifest.load(self.directory)
        if target is not None:
            _check_target(self.manifest, self.directory, target.name, target_fingerprint(target))

    # -- shape of the cache --

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest.layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.manifest.hidden_size

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    def __len__(self) -> int:
        return self.manifest.num_sequences

    @property
    def complete(self) -> bool:
        return all(s.complete for s in self.manifest.shards)

    # -- integrity --

    def verify(self, raise_on_error: bool = True) -> VerifyReport:
        """Check every shard (presence, size, sha256, header); one error listing all problems."""
        problems: dict[str, str] = {}
        readable = 0
        for info in self.manifest.shards:
            data = _read_bytes(self.directory / info.file)
            problem = _shard_problem(data, info, self.manifest)
            if problem is None:
                try:
                    _load_tensors(data, info, self.manifest)
                except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt shard
                    problem = f"unreadable ({e})"
            if problem is None:
                readable += info.num_sequences
            else:
                problems[info.file] = problem
        report = VerifyReport(len(self.manifest.shards), len(self), readable, problems)
        if problems and raise_on_error:
            listed = "; ".join(f"{f} is {p}" for f, p in problems.items())
            raise CacheIntegrityError(
                f"feature cache {self.directory}: {listed}. {readable} of {len(self)} sequences are still "
                f"readable (in {report.num_shards - len(problems)} intact shards of {report.num_shards}); "
                + ("rerun the cache writer with the same inputs to finish it"
                   if all(p == NOT_WRITTEN for p in problems.values())
                   else "delete the damaged shard files and rerun the cache writer to recompute them")
            )
        return report

    # -- reading --

    def shard(self, index: int) -> list[SequenceFeatures]:
        """The sequences of one shard; a damaged shard raises with the whole cache's count."""
        info = self.manifest.shards[index]
        data = _read_bytes(self.directory / info.file)
        problem = _shard_problem(data, info, self.manifest)
        if problem is None:
            try:
                tensors = _load_tensors(data, info, self.manifest)
            except Exception:  # noqa: BLE001
                problem = "unreadable"
        if problem is not None:
            self.verify()  # raises, naming every bad shard and how much is still readable
            raise CacheIntegrityError(f"{self.directory / info.file} is {problem}")  # pragma: no cover
        sizes = tensors["lengths"].long().tolist()
        ids, mask = tensors["input_ids"].long(), tensors["loss_mask"].long()
        return [
            SequenceFeatures(i, m, t, h, info.first_sequence + k)
            for k, (i, m, t, h) in enumerate(zip(ids.split(sizes), mask.split(sizes),
                                                 tensors["taps"].split(sizes), tensors["hidden"].split(sizes)))
        ]

    def __iter__(self) -> Iterator[SequenceFeatures]:
        for index in range(len(self.manifest.shards)):
            yield from self.shard(index)


# -- writing -----------------------------------------------------------------------------------


def _plan(target: Any, pairs: Sequence[tuple[Tensor, Tensor]], layer_ids: list[int], dtype: torch.dtype,
          sequences_per_shard: int, fingerprint: str) -> CacheManifest:
    shards = []
    for k, first in enumerate(range(0, len(pairs), sequences_per_shard)):
        chunk = pairs[first : first + sequences_per_shard]
        shards.append(ShardInfo(f"shard-{k:05d}.safetensors", first, len(chunk), sum(len(p[0]) for p in chunk),
                                _inputs_sha256(chunk)))
    args = target.args
    return CacheManifest(
        target_name=target.name, target_fingerprint=fingerprint, target_args=asdict(args),
        num_target_layers=args.n_layers, layer_ids=layer_ids, hidden_size=args.dim,
        feature_dtype=dtype_name(dtype), compute_dtype=target.precision_label,
        sequences_per_shard=sequences_per_shard, num_sequences=len(pairs),
        num_tokens=sum(len(p[0]) for p in pairs), shards=shards,
    )


def _resume(directory: Path, planned: CacheManifest) -> CacheManifest:
    """The manifest to continue from: the planned one, with the shards already on disk adopted.

    Everything is checked before anything is computed; a mismatch or a damaged shard raises and
    leaves the directory as it was (the user decides whether to delete what is there).
    """
    on_disk = CacheManifest.load(directory)
    _check_target(on_disk, directory, planned.target_name, planned.target_fingerprint)
    planned.check_resumes(on_disk, directory)
    for info, done in zip(planned.shards, on_disk.shards):
        data = _read_bytes(directory / info.file)
        if done.complete:
            problem = _shard_problem(data, done, on_disk)
        elif data is not None:
            # Written (atomically, so whole) but the run died before recording it: adopt it if it
            # holds what this run would compute; never replace it.
            problem = _content_problem(data, info, planned)
            if problem is None:
                try:
                    _load_tensors(data, info, planned)
                except Exception as e:  # noqa: BLE001
                    problem = f"unreadable ({e})"
        else:
            continue
        if problem is not None:
            good = sum(s.num_sequences for s in on_disk.shards if s.complete and s.file != info.file)
            raise CacheIntegrityError(
                f"feature cache {directory}: {info.file} is {problem}; {good} sequences in other complete "
                f"shards are intact. Nothing was written: delete {info.file} to have it recomputed"
            )
        info.sha256, info.num_bytes = hashlib.sha256(data).hexdigest(), len(data)
    return planned


def write_feature_cache(
    target: Any,
    sequences: Sequence[Any],
    directory: str | Path,
    layer_ids: Sequence[int],
    *,
    dtype: torch.dtype | str | None = None,
    sequences_per_shard: int = 256,
    max_batch_tokens: int = 8192,
    progress: bool = True,
    log: Any = print,
) -> FeatureCache:
    """Compute and store the features of ``sequences``; resumes a killed run in ``directory``.

    ``layer_ids`` are 0-based target layers (id i = output of layer i); ``dtype`` is the stored
    feature dtype (default: the target's).  Shards already complete and verified are skipped.
    """
    directory = Path(directory)
    layer_ids = check_layer_ids(layer_ids, target.args.n_layers)  # before any work or any file
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else (dtype or target.dtype)
    if sequences_per_shard < 1:
        raise FeatureCacheError("sequences_per_shard must be at least 1")
    pairs = [as_pair(s) for s in sequences]
    validate_sequences(pairs, target)
    fingerprint = target_fingerprint(target)
    planned = _plan(target, pairs, layer_ids, dtype, sequences_per_shard, fingerprint)
    if (directory / MANIFEST).exists():
        manifest = _resume(directory, planned)
    elif directory.exists() and any(p for p in directory.iterdir() if not p.name.startswith(".")):
        raise FeatureCacheError(f"{directory} is not empty and holds no {MANIFEST}; refusing to write into it")
    else:
        manifest = planned
    todo = [i for i, s in enumerate(manifest.shards) if not s.complete]
    todo_tokens = sum(manifest.shards[i].num_tokens for i in todo)
    total = estimate_size(manifest.num_tokens, layer_ids, manifest.hidden_size, dtype, manifest.num_sequences)
    remaining = estimate_size(todo_tokens, layer_ids, manifest.hidden_size, dtype,
                              sum(manifest.shards[i].num_sequences for i in todo))
    log(f"feature cache {directory}: {manifest.num_sequences} sequences, {manifest.num_tokens} tokens, "
        f"{len(layer_ids)} layers + last hidden × {manifest.hidden_size} in {dtype_name(dtype)} ≈ "
        f"{format_bytes(total)}; {len(todo)} of {len(manifest.shards)} shards to write "
        f"(≈ {format_bytes(remaining)})")
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if remaining > free:
        raise FeatureCacheError(f"{directory}: the cache needs ≈ {format_bytes(remaining)} more, "
                                f"only {format_bytes(free)} are free")
    remove_leftovers(directory)
    manifest.save(directory)  # adopted shards are recorded even if nothing is left
    from tqdm.auto import tqdm

    bar = tqdm(total=todo_tokens, unit="tok", desc="features", disable=not progress)
    for i in todo:
        info = manifest.shards[i]
        chunk = pairs[info.first_sequence : info.first_sequence + info.num_sequences]
        taps, hidden = forward_flat(target, [p[0] for p in chunk], layer_ids, dtype, max_batch_tokens)
        data = _shard_bytes(chunk, taps, hidden, i, info.inputs_sha256, fingerprint)
        _write_new_file(directory / info.file, data)
        info.sha256, info.num_bytes = hashlib.sha256(data).hexdigest(), len(data)
        manifest.save(directory)
        bar.update(info.num_tokens)
    bar.close()
    return FeatureCache(directory)
