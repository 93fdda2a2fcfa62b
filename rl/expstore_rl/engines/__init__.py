"""Generation engines: ``TorchEngine`` (CPU or GPU, always available) and ``VLLMEngine``
(optional; imported only when asked for, as ``expstore_rl.engines.vllm_engine``)."""

from .base import Engine, EpisodeSession, Generation, ResubmitSession, SamplingParams
from .torch_engine import TorchEngine

__all__ = ["Engine", "EpisodeSession", "Generation", "ResubmitSession", "SamplingParams", "TorchEngine"]
