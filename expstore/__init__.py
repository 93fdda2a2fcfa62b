"""expstore engine: tables, samplers, rate limiters and tiers for RL experience.

This package knows nothing of gRPC. The wire helpers it shares with the client
(``expstore_proto``: Arrow IPC framing, the generated stubs) ship in the expstore-client
distribution, so that a trainer installs the client without the engine's storage stack.
"""

__version__ = "0.1.0"
