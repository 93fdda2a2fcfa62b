"""The one place where engine errors become gRPC statuses."""

from __future__ import annotations

import grpc

from expstore.errors import ExpstoreError


def status_of(error: ExpstoreError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)
