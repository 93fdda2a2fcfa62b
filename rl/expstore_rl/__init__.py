"""Rollout producers and trainers around expstore; they talk to the store only through
``expstore_client``."""
