"""hypic: position-independent caching for hybrid-attention LLMs."""

from .config import CacheMode, CachePolicy, EngineConfig, ModelConfig, ParallelConfig
from .errors import ConfigError, HypicError, InvalidRequestError, UnsupportedArchitectureError, WeightsError, WorkerError
from .llm import LLM
from .types import Prompt, RequestOutput, SamplingParams, Segment

__version__ = "0.1.0"
__all__ = ["LLM", "CacheMode", "CachePolicy", "ConfigError", "EngineConfig", "HypicError", "InvalidRequestError",
           "ModelConfig", "ParallelConfig", "Prompt", "RequestOutput", "SamplingParams", "Segment", "UnsupportedArchitectureError",
           "WeightsError", "WorkerError"]
