"""Target features for drafter training: the offline cache, the online mode, anchor packing.

See :mod:`.manifest` for the cache's on-disk format and :mod:`.packing` for the packed-block
attention format.
"""

from specforge.features.cache import FeatureCache, VerifyReport, write_feature_cache
from specforge.features.compute import (
    OnlineFeatures,
    SequenceFeatures,
    compute_features,
    project_logits,
    stack_context,
)
from specforge.features.manifest import (
    CacheIntegrityError,
    CacheManifest,
    CacheMismatchError,
    FeatureCacheError,
    LayerRangeError,
    ShardInfo,
    default_layer_ids,
    estimate_size,
    target_fingerprint,
)
from specforge.features.packing import PackedBlocks, anchor_candidates, flex_block_mask, pack_blocks, sample_anchors

__all__ = [
    "CacheIntegrityError",
    "CacheManifest",
    "CacheMismatchError",
    "FeatureCache",
    "FeatureCacheError",
    "LayerRangeError",
    "OnlineFeatures",
    "PackedBlocks",
    "SequenceFeatures",
    "ShardInfo",
    "VerifyReport",
    "anchor_candidates",
    "compute_features",
    "default_layer_ids",
    "estimate_size",
    "flex_block_mask",
    "pack_blocks",
    "project_logits",
    "sample_anchors",
    "stack_context",
    "target_fingerprint",
    "write_feature_cache",
]
