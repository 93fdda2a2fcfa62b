"""expstore-server: the gRPC daemon around the expstore engine.

The servicer only translates: wire -> engine call -> wire, with errors mapped to gRPC
status codes in one place (``errors.py``). No storage logic lives here.
"""
