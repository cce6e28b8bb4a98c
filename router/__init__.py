"""specmesh router: the front door — gRPC `specmesh.v1.Router` (proto/specmesh/v1/router.proto)
and an OpenAI-compatible HTTP API — placing sessions on verifiers and drafters, with all session
state in Redis so that any number of router replicas serve any session.

    redis-server --port 6379 &
    python -m verifier_service --port 50051 --threads 1 --redis-url redis://127.0.0.1:6379/0 &
    python -m router.register --redis-url redis://127.0.0.1:6379/0 --role drafter --address HOST:PORT &  # sidecar
    python -m router --port 50050 --http-port 8000 --redis-url redis://127.0.0.1:6379/0 --api-key KEY
    # gRPC: specmesh.client.Client("127.0.0.1:50050", api_key="KEY").complete("Hello", max_tokens=16)
    # HTTP: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY").chat.completions.create(...)

Security and limits: bearer API keys (`--api-key`); per-request limits -> INVALID_ARGUMENT / 400
naming the limit; `--max-sessions-per-key N`: a key holds at most N live sessions (a session
lives from its first turn until the session TTL after its last, or CloseSession), counted in
Redis across all router replicas (state, `keysess:`). A *new* session beyond N gets
RESOURCE_EXHAUSTED / 429 (`error.code` "max_sessions_per_key", sent with `x-should-retry: false`
so the openai client and the SDK do not retry it); the key's existing sessions and other keys go
on. Requests without a session id (the OpenAI API's stateless default, as with vLLM) keep no
state in the router and are **not** counted: the limit bounds the state a key can pin (bindings,
histories, verifiers' KV caches), not its request rate. TLS: `--tls-cert/--tls-key` serve both
ports over TLS, `--tls-client-ca` requires client certificates (mTLS); `--peer-ca/--peer-cert/
--peer-key` dial verifiers over (m)TLS (specmesh.tls). Without these flags, plaintext as before.

Modules: policies (pure placement) · state (Redis keys, TTLs, sizes) · register (heartbeat of
verifiers/drafters, in process or as a sidecar) · text (stops and text from token ids) · turns
(one turn: place, forward, record, fail over) · servicer / http_api (transport) · errors (one
status table) · metrics (Prometheus) · server (both ports, one event loop) · config.
"""
