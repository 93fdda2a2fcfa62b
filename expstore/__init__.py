"""expstore engine: tables, samplers, rate limiters and tiers for RL experience.

This package knows nothing of gRPC. Importing it is cheap on purpose: the client imports
``expstore.proto`` (and so this file), and must not pull storage dependencies.
"""

__version__ = "0.1.0"
