"""retry_unavailable: only UNAVAILABLE is retried, up to its deadline."""

from __future__ import annotations

import grpc
import pytest

from expstore_client.retry import retry_unavailable


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


def failing(times: int, code: grpc.StatusCode):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise Refused(code)
        return len(calls)
    return call, calls


def test_unavailable_is_retried_until_the_call_succeeds_and_each_retry_is_heard():
    call, calls = failing(3, grpc.StatusCode.UNAVAILABLE)
    heard = []
    assert retry_unavailable(call, 10.0, heard.append) == 4
    assert [e.code() for e in heard] == [grpc.StatusCode.UNAVAILABLE] * 3


def test_any_other_status_is_raised_at_once():
    call, calls = failing(1, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as e:
        retry_unavailable(call, 10.0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(calls) == 1


def test_past_the_deadline_the_last_unavailable_is_raised():
    call, calls = failing(1000, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError) as e:
        retry_unavailable(call, 0.5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and 2 <= len(calls) < 10
