"""Where a training step's sequences come from: feature sources, epoch order, rank shards, anchors.

Everything random here is a pure function of ``(seed, epoch, sequence index)`` — not of a global
RNG stream, the rank or the world size — so a resumed run, a single process and ``torchrun`` with
N ranks all see the same global batches with the same anchors.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from specforge.features import (
    FeatureCache,
    FeatureCacheError,
    OnlineFeatures,
    SequenceFeatures,
    anchor_candidates,
    sample_anchors,
    write_feature_cache,
)
from specforge.features.compute import as_pair
from specforge.training.config import TrainConfigError

__all__ = ["FeatureSource", "MemorySource", "OfflineSource", "OnlineSource", "anchors_for", "build_source", "epoch_order",
           "load_conversations", "load_sequences", "mix_seed", "regenerate_answers"]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers: unrelated streams for nearby (seed, epoch, index) triples."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class FeatureSource(Protocol):
    layer_ids: list[int]

    def __len__(self) -> int: ...

    def groups(self) -> list[list[int]]:
        """Sequence indices in groups that are cheap to load together (cache shards)."""
        ...

    def get(self, indices: Sequence[int]) -> list[SequenceFeatures]: ...


class MemorySource:
    """Features already in memory (small runs and tests)."""

    def __init__(self, features: Sequence[SequenceFeatures], layer_ids: Sequence[int]) -> None:
        self.items = list(features)
        for i, f in enumerate(self.items):
            f.index = i  # anchors are seeded by the index, so it must be the position here
        self.layer_ids = list(layer_ids)

    def __len__(self) -> int:
        return len(self.items)

    def groups(self) -> list[list[int]]:
        return [list(range(len(self.items)))]

    def get(self, indices: Sequence[int]) -> list[SequenceFeatures]:
        return [self.items[i] for i in indices]


class OnlineSource:
    """Tokenised sequences whose features the target computes inside the training step."""

    def __init__(self, target: Any, sequences: Sequence[Any], layer_ids: Sequence[int],
                 dtype: torch.dtype | None = None) -> None:
        self.features = OnlineFeatures(target, layer_ids, dtype)
        self.layer_ids = list(self.features.layer_ids)
        self.pairs = [as_pair(s) for s in sequences]

    def __len__(self) -> int:
        return len(self.pairs)

    def groups(self) -> list[list[int]]:
        return [list(range(len(self.pairs)))]

    def get(self, indices: Sequence[int]) -> list[SequenceFeatures]:
        out = self.features([self.pairs[i] for i in indices])
        for f, i in zip(out, indices):
            f.index = i
        return out


class OfflineSource:
    """A :class:`FeatureCache` read shard by shard, keeping the last few shards in memory."""

    def __init__(self, cache: FeatureCache, keep_shards: int = 4) -> None:
        self.cache = cache
        self.layer_ids = cache.layer_ids
        self.keep = max(1, keep_shards)
        self._loaded: OrderedDict[int, list[SequenceFeatures]] = OrderedDict()
        shards = cache.manifest.shards
        self._where = {s.first_sequence + k: (i, k) for i, s in enumerate(shards) for k in range(s.num_sequences)}

    def __len__(self) -> int:
        return len(self.cache)

    def groups(self) -> list[list[int]]:
        return [list(range(s.first_sequence, s.first_sequence + s.num_sequences)) for s in self.cache.manifest.shards]

    def _shard(self, i: int) -> list[SequenceFeatures]:
        if i in self._loaded:
            self._loaded.move_to_end(i)
        else:
            self._loaded[i] = self.cache.shard(i)  # checks the shard's sha256 on every load
            while len(self._loaded) > self.keep:
                self._loaded.popitem(last=False)
        return self._loaded[i]

    def get(self, indices: Sequence[int]) -> list[SequenceFeatures]:
        return [self._shard(self._where[i][0])[self._where[i][1]] for i in indices]


def epoch_order(groups: Sequence[Sequence[int]], seed: int, epoch: int, window: int,
                exclude: set[int] = frozenset()) -> list[int]:
    """This epoch's sequence order: groups (shards) shuffled, then sequences shuffled inside each
    window of ``window`` consecutive groups, so an offline cache is read a few shards at a time."""
    gen = torch.Generator().manual_seed(mix_seed(seed, epoch, "order"))
    perm = torch.randperm(len(groups), generator=gen).tolist()
    order: list[int] = []
    for start in range(0, len(perm), window):
        members = [i for g in perm[start:start + window] for i in groups[g] if i not in exclude]
        order += [members[j] for j in torch.randperm(len(members), generator=gen).tolist()]
    return order


def anchors_for(features: Sequence[SequenceFeatures], max_anchors: int, seed: int, epoch: int) -> list[Tensor]:
    """Each sequence's anchors from its own generator: independent of batch composition and rank."""
    return [sample_anchors(f.loss_mask.cpu(), max_anchors, torch.Generator().manual_seed(mix_seed(seed, epoch, f.index)))
            for f in features]


# -- building a source from the config ---------------------------------------------------------


def load_conversations(config: Any, progress: bool = True) -> list[Any]:
    """The conversations ``config.data`` names (the ShareGPT wheel or a JSONL file)."""
    from specforge.conversations.jsonl import load_jsonl
    from specforge.data import load_sharegpt

    data = config.data
    if data.source == "sharegpt":
        conversations, _ = load_sharegpt(limit=data.limit, progress=progress)
    else:
        if not Path(data.source).is_file():
            raise TrainConfigError([f"data.source: no such file {data.source!r} (give 'sharegpt' or a JSONL path)"])
        conversations, _ = load_jsonl(data.source, limit=data.limit)
    return conversations


def regenerated_dir(config: Any, out_dir: Path) -> Path:
    regen = config.data.regenerate
    return Path(regen.dir) if regen.dir else out_dir / "regenerated"


def regenerate_answers(config: Any, target: Any, out_dir: Path, log: Callable[[str], None] = print,
                       progress: bool = True) -> Path:
    """Answer the conversations' user turns with the target (resumes a partial run; a complete
    one is reused as it is).  Returns the output directory."""
    from specforge.data.regeneration import regenerate

    regen = config.data.regenerate
    directory = regenerated_dir(config, out_dir)
    conversations = load_conversations(config, progress)
    # Training keeps the first data.max_length tokens of a conversation, so the engine's context
    # stops there too: a prompt that leaves no room for an answer inside it is skipped, and no
    # answer token is decoded that training would cut off (a long prompt also makes every request
    # of its batch pay for its length in the padded attention).
    report = regenerate(conversations, target, directory, source=config.data.source, turns=regen.turns,
                        max_new_tokens=regen.max_new_tokens, seed=regen.seed, shard_size=regen.shard_size,
                        max_batch=regen.max_batch, max_context=config.data.max_length,
                        temperature=regen.temperature, top_k=regen.top_k, top_p=regen.top_p, progress=progress)
    log(f"regenerated answers: {report.summary()}")
    return directory


def load_sequences(config: Any, target: Any, out_dir: Path, log: Callable[[str], None] = print,
                   progress: bool = True) -> list[tuple[Tensor, Tensor]]:
    """Conversations of ``config.data`` (with the target's own answers when
    ``data.regenerate.enabled``: :func:`regenerate_answers` must have run) tokenised with the chat
    template, keeping those with at least one anchor (an assistant token followed by another)."""
    from specforge.conversations.chat import tokenize_conversation
    from specforge.data.regeneration import iter_regenerated

    data = config.data
    if data.regenerate.enabled:
        source = str(regenerated_dir(config, out_dir))
        conversations = list(iter_regenerated(source))
    else:
        source = data.source
        conversations = load_conversations(config, progress)
    pairs = []
    for conv in conversations:
        tok = tokenize_conversation(target.tokenizer, conv, max_length=data.max_length)
        if len(anchor_candidates(tok.loss_mask)):
            pairs.append((tok.input_ids, tok.loss_mask))
    log(f"data: {len(conversations)} conversations from {source}, {len(pairs)} with assistant tokens "
        f"to train on ({sum(len(p[0]) for p in pairs)} tokens, ≤{data.max_length} each)")
    if not pairs:
        raise ValueError(f"data.source {source!r} gave no conversation with assistant tokens to train on")
    return pairs


def build_source(config: Any, target: Any, layer_ids: Sequence[int], out_dir: Path, dist: Any,
                 log: Callable[[str], None] = print) -> FeatureSource:
    """The config's feature source.  Offline: rank 0 writes (or resumes, or reuses) the cache while
    the other ranks wait, then every rank reads it."""
    if target.tokenizer is None:
        raise ValueError(f"target {target.name!r} has no tokenizer to prepare data.source with")
    feats = config.features
    progress = config.output.progress and dist.is_main
    if config.data.regenerate.enabled:  # rank 0 answers; the others wait, then read its output
        if dist.is_main:
            regenerate_answers(config, target, out_dir, log, progress)
        dist.barrier()
    if feats.mode == "online":
        return OnlineSource(target, load_sequences(config, target, out_dir, log, progress), layer_ids)
    cache_dir = Path(feats.cache_dir) if feats.cache_dir else out_dir / "features"
    if dist.is_main:
        pairs = load_sequences(config, target, out_dir, log, progress)
        write_feature_cache(target, pairs, cache_dir, layer_ids, dtype=feats.dtype,
                            sequences_per_shard=feats.sequences_per_shard, progress=progress, log=log)
    dist.barrier()
    cache = FeatureCache(cache_dir, target)
    if cache.layer_ids != list(layer_ids):
        raise FeatureCacheError(f"feature cache {cache_dir} taps layers {cache.layer_ids}; the drafter wants "
                                f"{list(layer_ids)} (drafter.target_layers)")
    return OfflineSource(cache, feats.shuffle_window + 1)
