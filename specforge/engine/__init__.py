"""The decoding engine: continuous batching of speculative rounds."""

from specforge.engine.bind import load_pipeline_target
from specforge.engine.engine import Engine
from specforge.engine.request import FinishReason, GenerationRequest, RequestOutput, RequestStats, StreamEvent

__all__ = ["Engine", "load_pipeline_target", "FinishReason", "GenerationRequest", "RequestOutput", "RequestStats", "StreamEvent"]
