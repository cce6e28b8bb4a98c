"""A shared service token on the internal gRPC ports: verifiers and drafters given one refuse
every call that does not carry it, so reaching a verifier's or a drafter's port is not enough to
use it (a direct Generate bypassing the router's API keys, a scoped session id of another key, a
drafter session made to hold memory).

- Servers: `interceptors(token)` for `grpc.server(..., interceptors=...)`. A call must carry the
  metadata `x-specmesh-service-token: <token>` (compared in constant time), else it ends
  UNAUTHENTICATED before reaching the service. `grpc.health.v1` stays open: Kubernetes' native
  gRPC probes and the registry sidecar send no metadata, and health says nothing of a session.
- Channels: `specmesh.tls.peer_channel` adds the token to every call when `PeerTls.token` is set
  (router -> verifier, verifier -> drafter).
- Where it comes from: $SPECMESH_SERVICE_TOKEN (`--service-token` exists, but a flag shows in
  `ps`). `specmesh up` generates one per start and gives it to its children in their environment;
  the Kubernetes manifests read it from the Secret `specmesh-service-token`.

The token authenticates, it does not encrypt: over networks others can read, combine it with
TLS (specmesh.tls), which also gives mutual authentication without a shared secret.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections import namedtuple

import grpc

ENV = "SPECMESH_SERVICE_TOKEN"
HEADER = "x-specmesh-service-token"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def add_token_arg(p: argparse.ArgumentParser, env=os.environ.get) -> None:
    p.add_argument("--service-token", default=env(ENV, ""),
                   help=f"shared token of the internal ports ('' = none required / sent; prefer the variable: a flag "
                        f"shows in ps) (env {ENV})")


class _Require(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def _carries(self, metadata) -> bool:
        got = next((v for k, v in metadata or () if k == HEADER), None)
        return got is not None and hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._token)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES) or self._carries(details.invocation_metadata):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"service token: missing or wrong ({HEADER} metadata; internal port)")

        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def interceptors(token: str) -> list[grpc.ServerInterceptor]:
    """Server interceptors requiring `token` ([] when it is "")."""
    return [_Require(token)] if token else []


class _Details(namedtuple("_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                       "compression")), grpc.ClientCallDetails):
    pass


def _with_token(details, token: str):
    metadata = [*(details.metadata or ()), (HEADER, token)]
    return _Details(details.method, details.timeout, metadata, details.credentials,
                    getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


class _Send(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(_with_token(details, self.token), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(_with_token(details, self.token), requests)


def _aio_details(details, token: str) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(details.method, details.timeout,
                                      grpc.aio.Metadata(*(details.metadata or ()), (HEADER, token)),
                                      details.credentials, details.wait_for_ready)


class _AioToken:
    """Base of the grpc.aio interceptors below: each adds the token to its kind of call."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def _intercept(self, continuation, details, request):
        return await continuation(_aio_details(details, self.token), request)


# grpc.aio files an interceptor under the first call kind it is, so one class per kind
_AIO_KINDS = [type(f"_Aio{base.__name__}", (_AioToken, base), {f"intercept_{kind}": _AioToken._intercept})
              for kind, base in (("unary_unary", grpc.aio.UnaryUnaryClientInterceptor),
                                 ("unary_stream", grpc.aio.UnaryStreamClientInterceptor),
                                 ("stream_unary", grpc.aio.StreamUnaryClientInterceptor),
                                 ("stream_stream", grpc.aio.StreamStreamClientInterceptor))]


def sending(channel: grpc.Channel, token: str) -> grpc.Channel:
    """A sync channel whose calls carry `token` (the channel itself when it is "")."""
    return grpc.intercept_channel(channel, _Send(token)) if token else channel


def aio_interceptors(token: str) -> list:
    """Interceptors for a `grpc.aio` channel whose calls carry `token` ([] when it is "")."""
    return [k(token) for k in _AIO_KINDS] if token else []
