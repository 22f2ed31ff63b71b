"""Target models: loading, the flattened-batch runtime and its KV cache."""

from specforge.target.adapter import TargetModel
from specforge.target.args import ModelArgs, UnsupportedModelError
from specforge.target.batch import VarlenBatch
from specforge.target.cache import CacheFullError, KVCache
from specforge.target.loading import TargetLoadError

__all__ = [
    "CacheFullError",
    "KVCache",
    "ModelArgs",
    "TargetLoadError",
    "TargetModel",
    "UnsupportedModelError",
    "VarlenBatch",
]
