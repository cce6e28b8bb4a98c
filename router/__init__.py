"""specmesh router: the front door — gRPC `specmesh.v1.Router` (proto/specmesh/v1/router.proto)
and an OpenAI-compatible HTTP API — placing sessions on verifiers and drafters, with all session
state in Redis so that any number of router replicas serve any session.

    redis-server --port 6379 &
    python -m verifier_service --port 50051 --threads 1 --redis-url redis://127.0.0.1:6379/0 &
    python -m router.register --redis-url redis://127.0.0.1:6379/0 --role drafter --address HOST:PORT &  # sidecar
    python -m router --port 50050 --http-port 8000 --redis-url redis://127.0.0.1:6379/0 --api-key KEY
    # gRPC: specmesh.client.Client("127.0.0.1:50050", api_key="KEY").complete("Hello", max_tokens=16)
    # HTTP: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY").chat.completions.create(...)

Modules: policies (pure placement) · state (Redis keys, TTLs, sizes) · register (heartbeat of
verifiers/drafters, in process or as a sidecar) · text (stops and text from token ids) · turns
(one turn: place, forward, record, fail over) · servicer / http_api (transport) · errors (one
status table) · metrics (Prometheus) · server (both ports, one event loop) · config.
"""
