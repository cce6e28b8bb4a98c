"""Domain errors of the router and the one table mapping them to a gRPC status, an HTTP status
and an OpenAI error type. Transport modules raise nothing else and map nothing themselves."""

from __future__ import annotations

import re
from enum import StrEnum

import grpc


class Kind(StrEnum):
    INVALID = "invalid"                # bad input, a limit exceeded
    UNAUTHENTICATED = "unauthenticated"
    NOT_FOUND = "not_found"            # unknown model
    BUSY = "busy"                      # the session has a turn in progress
    EXHAUSTED = "exhausted"            # rate or quota
    TIMEOUT = "timeout"                # the client's request did not arrive in time (HTTP 408)
    UNAVAILABLE = "unavailable"        # no verifier, Redis down, every attempt failed
    INTERNAL = "internal"


# kind -> (gRPC status, HTTP status, OpenAI error type)
STATUS: dict[Kind, tuple[grpc.StatusCode, int, str]] = {
    Kind.INVALID: (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    Kind.UNAUTHENTICATED: (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    Kind.NOT_FOUND: (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    Kind.BUSY: (grpc.StatusCode.FAILED_PRECONDITION, 409, "invalid_request_error"),
    Kind.EXHAUSTED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    Kind.TIMEOUT: (grpc.StatusCode.DEADLINE_EXCEEDED, 408, "invalid_request_error"),
    Kind.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
    Kind.INTERNAL: (grpc.StatusCode.INTERNAL, 500, "server_error"),
}

# A verifier's answer that is the client's fault is passed on as it is, never retried.
_FROM_UPSTREAM: dict[grpc.StatusCode, Kind] = {
    grpc.StatusCode.INVALID_ARGUMENT: Kind.INVALID,
    grpc.StatusCode.OUT_OF_RANGE: Kind.INVALID,
    grpc.StatusCode.FAILED_PRECONDITION: Kind.BUSY,
}


# Sent with an error that a prompt retry cannot cure (gRPC trailing metadata, HTTP header): the
# official openai client and specmesh.client then do not retry a status they otherwise would.
NO_RETRY = ("x-should-retry", "false")


class RouterError(Exception):
    def __init__(self, kind: Kind, message: str, code: str | None = None, final: bool = False,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code  # OpenAI `error.code` (e.g. the limit's name); None = unset
        self.final = final  # retrying soon will not help (e.g. a quota): NO_RETRY goes with it
        self.param = param  # the request field at fault where it is not `code` (an unknown model: "model")

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        return (NO_RETRY,) if self.final else ()

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return STATUS[self.kind][0]

    @property
    def http_status(self) -> int:
        return STATUS[self.kind][1]

    def openai_body(self) -> dict:
        param = self.param or (self.code if self.kind is Kind.INVALID else None)  # OpenAI: the offending parameter
        return {"error": {"message": self.message, "type": STATUS[self.kind][2], "param": param, "code": self.code}}


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def field_of(message: str) -> str | None:
    """The field an upstream error names: its messages start with "<field>: " (this project's rule)."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def client_fault(code: grpc.StatusCode) -> Kind | None:
    """The kind of an upstream status that is the request's fault (not retried), else None."""
    return _FROM_UPSTREAM.get(code)


def invalid(field: str, message: str) -> RouterError:
    """Bad input or a limit exceeded; the message starts with the field or limit's name."""
    return RouterError(Kind.INVALID, f"{field}: {message}", code=field)
