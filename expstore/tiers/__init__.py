"""Payload tiers. A tier holds immutable Arrow record batches ("chunks") by chunk id and
knows its byte budget; it never sees sampling policy (see ``base.Tier``)."""

from .base import Tier
from .memory import MemoryTier

__all__ = ["Tier", "MemoryTier"]
