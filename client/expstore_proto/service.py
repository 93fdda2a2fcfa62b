"""The service's method table with the serializers both sides use.

Methods whose messages carry Arrow payloads use ``framing`` instead of protobuf for the
payload field: the client sends ``InsertRequest`` and the server sends ``RowsResponse``
as pre-framed bytes, and each side decodes them into ``(message, payload memoryview)``.
Every other method uses the generated protobuf (de)serializers. The bytes on the wire are
plain protobuf either way.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from . import framing
from .v1 import expstore_pb2 as pb

SERVICE = "expstore.v1.ExperienceStore"
INSERT_PAYLOAD = pb.InsertRequest.DESCRIPTOR.fields_by_name["arrow_ipc"].number
ROWS_PAYLOAD = pb.RowsResponse.DESCRIPTOR.fields_by_name["arrow_ipc"].number
ORDER_KEY = "expstore-order"  # call metadata ORIGIN:SEQ:LOW: a client's inserts and samples in order (docs/rpc.md)


def _identity(data: bytes) -> bytes:
    return data


class Malformed(NamedTuple):
    """What a server-side deserializer returns for bytes it cannot parse, so that the
    servicer answers INVALID_ARGUMENT (grpc would answer INTERNAL for a raising one)."""

    error: str


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, ValueError: any malformed input
            return Malformed(f"{type(e).__name__}: {e}")
    return parse


def decode_insert(data: bytes) -> tuple[pb.InsertRequest, memoryview]:
    return framing.decode(data, pb.InsertRequest, INSERT_PAYLOAD)


def decode_rows(data: bytes) -> tuple[pb.RowsResponse, memoryview]:
    return framing.decode(data, pb.RowsResponse, ROWS_PAYLOAD)


class Method(NamedTuple):
    name: str
    client_streaming: bool
    server_streaming: bool
    serialize_request: Callable[[Any], bytes]
    deserialize_request: Callable[[bytes], Any]
    serialize_response: Callable[[Any], bytes]
    deserialize_response: Callable[[bytes], Any]

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


def _methods() -> dict[str, Method]:
    out = {}
    for m in pb.DESCRIPTOR.services_by_name["ExperienceStore"].methods:
        req, resp = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        ser_req, de_req = req.SerializeToString, req.FromString
        ser_resp, de_resp = resp.SerializeToString, resp.FromString
        if req is pb.InsertRequest:
            ser_req, de_req = _identity, decode_insert
        if resp is pb.RowsResponse:
            ser_resp, de_resp = _identity, decode_rows
        out[m.name] = Method(m.name, m.client_streaming, m.server_streaming, ser_req, de_req, ser_resp, de_resp)
    return out


METHODS = _methods()


def client_stub(channel) -> Any:
    """Multi-callables for every method on a grpc.Channel or grpc.aio.Channel."""
    stub = type("ExperienceStoreStub", (), {})()
    for m in METHODS.values():
        kind = ("stream" if m.client_streaming else "unary") + "_" + ("stream" if m.server_streaming else "unary")
        setattr(stub, m.name, getattr(channel, kind)(m.path, request_serializer=m.serialize_request,
                                                      response_deserializer=m.deserialize_response))
    return stub


def server_handler(servicer) -> Any:
    """A generic handler serving ``servicer``'s methods (same names as the RPCs)."""
    import grpc

    handlers = {}
    for m in METHODS.values():
        kind = ("stream" if m.client_streaming else "unary") + "_" + ("stream" if m.server_streaming else "unary")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[m.name] = make(getattr(servicer, m.name), request_deserializer=_tolerant(m.deserialize_request),
                                response_serializer=m.serialize_response)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
