"""Integration tests: a real expstore-server subprocess on 127.0.0.1, driven over gRPC.

A package (rather than loose modules) so that test file names here never collide with
same-named files under tests/unit.
"""
