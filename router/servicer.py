"""gRPC servicer of the router (grpc.aio): authenticate, check limits, convert a GenerateRequest
to a TurnRequest, run it, convert Deltas and Done back. RouterErrors become statuses here and
nowhere else (errors.STATUS)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from router.errors import RouterError, invalid
from router.metrics import Metrics
from router.turns import Delta, Router, TurnRequest
from specmesh.v1 import router_pb2, router_pb2_grpc, verifier_pb2

API = "grpc"


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    return next((v for k, v in (context.invocation_metadata() or ()) if k == key), None)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    @property
    def metrics(self) -> Metrics:
        return self.router.metrics

    async def to_turn(self, request: verifier_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> TurnRequest:
        r = self.router
        key = r.auth.authenticate(_metadata(context, "authorization"))
        session_id = request.session_id or _metadata(context, "x-session-id") or ""
        r.check_request(request.ByteSize(), request.max_tokens, session_id, len(request.stop))
        if request.drafter_address:
            raise invalid("drafter_address", "set by the router, not by clients")
        if request.HasField("history"):
            raise invalid("history", "set by the router, not by clients")
        if request.resumed_output_tokens:
            raise invalid("resumed_output_tokens", "set by the router, not by clients")
        kind = request.WhichOneof("input")
        ids = list(request.token_ids.ids) if kind == "token_ids" else []
        if kind == "text":
            ids = await r.encode(request.text)
        template = verifier_pb2.GenerateRequest(
            sampling=request.sampling, stop=request.stop, stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos, speculation=request.speculation, prompt_logprobs=request.prompt_logprobs)
        if request.HasField("logprobs"):
            template.logprobs = request.logprobs
        if request.HasField("structured"):
            template.structured.CopyFrom(request.structured)
        remaining = context.time_remaining()
        return TurnRequest(
            session_id=session_id, ids=ids,
            stop=r.stop_conditions(request.max_tokens, tuple(request.stop), tuple(request.stop_token_ids),
                                   request.ignore_eos),
            template=template, deadline=None if remaining is None else time.monotonic() + remaining, key_id=key)

    async def Generate(self, request, context) -> AsyncIterator[verifier_pb2.GenerateResponse]:
        outcome = "ok"
        try:
            turn = await self.to_turn(request, context)
            async for ev in self.router.run(turn):
                if isinstance(ev, Delta):
                    yield verifier_pb2.GenerateResponse(chunk=verifier_pb2.Chunk(
                        token_ids=ev.token_ids, text=ev.text, logprobs=ev.logprobs, prompt_logprobs=ev.prompt_logprobs or []))
                else:
                    yield verifier_pb2.GenerateResponse(complete=verifier_pb2.Complete(
                        finish_reason=ev.finish_reason,
                        usage=verifier_pb2.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                                                 cached_prompt_tokens=ev.cached_prompt_tokens),
                        speculation=ev.speculation))
        except RouterError as e:
            outcome = e.kind.value
            await context.abort(e.grpc_status, e.message, e.headers)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.metrics.requests[(API, outcome)] += 1

    async def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        try:
            self.router.auth.authenticate(_metadata(context, "authorization"))
            models = await self.router.models()
        except RouterError as e:
            await context.abort(e.grpc_status, e.message)
        return router_pb2.ListModelsResponse(
            models=[router_pb2.Model(id=m, verifiers=v, drafters=d) for m, v, d in models])

    async def CloseSession(self, request, context) -> verifier_pb2.CloseSessionResponse:
        try:
            key = self.router.auth.authenticate(_metadata(context, "authorization"))
            if not request.session_id:
                raise invalid("session_id", "required")
            existed = await self.router.close_session(request.session_id, key)
        except RouterError as e:
            await context.abort(e.grpc_status, e.message)
        return verifier_pb2.CloseSessionResponse(existed=existed)
