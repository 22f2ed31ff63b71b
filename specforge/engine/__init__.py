"""The decoding engine: continuous batching of speculative rounds."""

from specforge.engine.engine import Engine
from specforge.engine.request import FinishReason, GenerationRequest, RequestOutput, RequestStats, StreamEvent

__all__ = ["Engine", "FinishReason", "GenerationRequest", "RequestOutput", "RequestStats", "StreamEvent"]
