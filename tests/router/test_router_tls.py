"""Security options of issue 4 with real processes on 127.0.0.1, a throwaway PKI (tests.certs) and
a real redis-server: a router serving TLS, a router requiring client certificates (mTLS) on both
ports, each dialling a verifier over mTLS that dials an ngram drafter over mTLS; and sessions per
API key (`--max-sessions-per-key`) over gRPC, HTTP and the official openai client."""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent import futures

import grpc
import openai
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.auth import key_id
from specmesh import tls
from specmesh.client import Client, SpecmeshError
from specmesh.v1 import router_pb2_grpc, verifier_pb2
from tests.certs import make_pki
from tests.e2e.procs import start
from tests.router.test_router_e2e import KEYS, http_address, wait_registered

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

K_GRPC, K_HTTP, K_OTHER, K_A, K_B = "key-grpc", "key-http", "key-other", "key-a", "key-b"
LIMIT = 2
PROMPT = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"  # repetitive: the ngram drafter has drafts to offer


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(redis_server, pki):
    """drafter <-mTLS- verifier <-mTLS- {router "mtls" (mTLS public ports, sessions per key), router
    "tls" (TLS public ports)}; every service presents server.pem and trusts ca.pem."""
    url = redis_server.url  # --grace-s 1: nothing is in flight at the end, and stops are then quick
    serve = ("--grace-s", "1", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-ca", pki.ca)
    dial = ("--peer-ca", pki.ca, "--peer-cert", pki.server_cert, "--peer-key", pki.server_key)
    public = ("--grace-s", "1", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key)
    with futures.ThreadPoolExecutor(3) as pool:
        mtls = pool.submit(start, "router", "--http-port", "0", "--redis-url", url, "--max-tokens", "16",
                           "--api-key", K_GRPC, "--api-key", K_HTTP, "--api-key", K_OTHER,
                           "--api-key", K_A, "--api-key", K_B,
                           "--max-sessions-per-key", str(LIMIT), *public, "--tls-client-ca", pki.ca, *dial)
        plain_tls = pool.submit(start, "router", "--http-port", "0", "--redis-url", url, *public, *dial)
        drafter = start("drafter_service", "--drafter", "ngram", *serve)
        verifier = pool.submit(start, "verifier_service", "--threads", "1", "--redis-url", url,
                               "--drafter-addr", drafter.address, *serve, *dial)
        procs = {"drafter": drafter, "verifier": verifier.result(), "mtls": mtls.result(), "tls": plain_tls.result()}
    r = redis.Redis.from_url(url)
    wait_registered(r, [procs["verifier"].address])
    yield procs
    r.close()
    for p in procs.values():
        p.stop()


def sdk(p, **kw) -> Client:
    return Client(p.address, timeout=120, retries=0, **kw)


def mtls_client(pki, cluster, key: str = K_GRPC) -> Client:
    return sdk(cluster["mtls"], api_key=key, root_ca=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)


def openai_client(pki, p, key: str = "", cert: bool = True, scheme: str = "https", **kw) -> openai.OpenAI:
    ctx = tls.client_ssl_context(pki.ca, *((pki.client_cert, pki.client_key) if cert else ()))
    return openai.OpenAI(base_url=f"{scheme}://{http_address(p)}/v1", api_key=key or "none",
                         http_client=openai.DefaultHttpxClient(verify=ctx, timeout=120), **kw)


def health_status(address: str, peer: tls.PeerTls) -> str:
    with tls.peer_channel(address, peer) as ch:
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status)
        except grpc.RpcError as e:
            return e.code().name


def test_mtls_chain_router_verifier_drafter_generates_with_speculation(pki, cluster):
    with mtls_client(pki, cluster) as c:
        spec = c.complete(PROMPT, max_tokens=16, ignore_eos=True)
        plain = c.complete(PROMPT, max_tokens=16, ignore_eos=True, speculate=False)
    assert spec.usage.completion_tokens == 16 and spec.token_ids == plain.token_ids
    assert spec.speculation.drafted_tokens > 0 and spec.speculation.accepted_tokens > 0  # the drafter link is up


def test_services_refuse_plaintext_and_peers_without_a_certificate(pki, cluster):
    for name in ("verifier", "drafter"):
        address = cluster[name].address
        assert health_status(address, tls.PeerTls(ca=pki.ca, cert=pki.server_cert, key=pki.server_key)) == "SERVING"
        assert health_status(address, tls.PeerTls()) == "UNAVAILABLE"             # plaintext
        assert health_status(address, tls.PeerTls(ca=pki.ca)) == "UNAVAILABLE"    # TLS, no certificate
        assert health_status(address, tls.PeerTls(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key)) == "UNAVAILABLE"


def test_tls_router_accepts_tls_clients_and_refuses_plaintext(pki, cluster):
    p = cluster["tls"]
    with sdk(p, root_ca=pki.ca) as c:
        assert c.list_models()[0].verifiers == 1
        assert c.complete("Hello", max_tokens=2).usage.completion_tokens == 2
    for kw in ({}, {"tls": True}):  # plaintext; TLS trusting only the system roots (not our CA)
        with sdk(p, **kw) as c, pytest.raises(SpecmeshError) as e:
            c.list_models()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    oa = openai_client(pki, p, cert=False, max_retries=0)
    assert oa.models.list().data[0].id
    assert oa.completions.create(model="", prompt="Hello", max_tokens=2, temperature=0).usage.completion_tokens == 2
    with pytest.raises(openai.APIConnectionError):
        openai_client(pki, p, cert=False, scheme="http", max_retries=0).models.list()


def test_mtls_router_refuses_clients_without_a_certificate(pki, cluster):
    p = cluster["mtls"]
    for kw in ({"root_ca": pki.ca}, {"root_ca": pki.ca, "client_cert": pki.rogue_cert, "client_key": pki.rogue_key}):
        with sdk(p, api_key=K_GRPC, **kw) as c, pytest.raises(SpecmeshError) as e:
            c.list_models()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.APIConnectionError):
        openai_client(pki, p, K_HTTP, cert=False, max_retries=0).models.list()
    assert openai_client(pki, p, K_HTTP, max_retries=0).models.list().data[0].id


def test_sessions_per_key_grpc(pki, cluster, redis_server):
    with mtls_client(pki, cluster) as c, mtls_client(pki, cluster, K_OTHER) as other:
        for sid in ("g-1", "g-2"):
            c.complete("Hi", max_tokens=2, session_id=sid)
        with pytest.raises(SpecmeshError) as e:
            c.complete("Hi", max_tokens=2, session_id="g-3")
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions_per_key" in e.value.details
        assert c.complete(" More.", max_tokens=2, session_id="g-1").usage.cached_prompt_tokens > 0  # still bound
        assert c.complete("Hi", max_tokens=2).usage.completion_tokens == 2    # one-shots are not counted
        assert other.complete("Hi", max_tokens=2, session_id="g-3").usage.completion_tokens == 2  # another key
        assert c.close_session("g-2")                                         # frees a slot
        assert c.complete("Hi", max_tokens=2, session_id="g-3").usage.completion_tokens == 2
    r = redis.Redis.from_url(redis_server.url)
    assert sorted(r.zrange(KEYS.key_sessions(key_id(K_GRPC)), 0, -1)) == [b"g-1", b"g-3"]
    r.close()
    # the refusal says "do not retry": the SDK and the openai client then give up at once
    creds = tls.channel_credentials(pki.ca, pki.client_cert, pki.client_key)
    with grpc.secure_channel(cluster["mtls"].address, creds) as ch, pytest.raises(grpc.RpcError) as e:
        list(router_pb2_grpc.RouterStub(ch).Generate(
            verifier_pb2.GenerateRequest(text="Hi", max_tokens=2, session_id="g-4"),
            metadata=(("authorization", f"Bearer {K_GRPC}"),), timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("x-should-retry", "false") in tuple(e.value.trailing_metadata())


def test_session_ids_are_scoped_per_api_key(pki, cluster, redis_server):
    """Key B naming key A's session id gets a fresh session: it neither sees nor extends A's context."""
    secret = "The password is pineapple. Repeat the password:"
    with mtls_client(pki, cluster, K_A) as a, mtls_client(pki, cluster, K_B) as b:
        first = a.complete(secret, max_tokens=4, session_id="shared")
        other = b.complete(" Hi", max_tokens=4, session_id="shared")
        assert other.usage.cached_prompt_tokens == 0
        assert other.usage.prompt_tokens < first.usage.prompt_tokens  # only its own " Hi"
        assert b.close_session("shared")  # B's own "shared": A's must survive it
        again = a.complete(" Again:", max_tokens=2, session_id="shared")
        assert again.usage.cached_prompt_tokens >= first.usage.prompt_tokens  # A's context is intact
    r = redis.Redis.from_url(redis_server.url)
    held = {k.decode() for k in r.scan_iter(match="*shared*")}
    r.close()
    assert any(key_id(K_A) + "/shared" in k for k in held) and not any(k.endswith(":shared") for k in held), held


def exhausted_http(pki, p) -> int:
    ctx = tls.client_ssl_context(pki.ca, pki.client_cert, pki.client_key)
    text = urllib.request.urlopen(f"https://{http_address(p)}/metrics", context=ctx, timeout=30).read().decode()
    m = re.search(r'^specmesh_router_requests_total\{api="http",outcome="exhausted"\} (\d+)', text, re.MULTILINE)
    return int(m.group(1)) if m else 0


def test_sessions_per_key_http_and_openai_client(pki, cluster):
    p = cluster["mtls"]
    oa = openai_client(pki, p, K_HTTP)  # default max_retries: a 429 is normally retried
    ask = [{"role": "user", "content": "Hi"}]
    first = oa.chat.completions.create(model="", messages=ask, max_tokens=2, temperature=0,
                                       extra_headers={"X-Session-ID": "h-1"})
    oa.completions.create(model="", prompt="Hi", max_tokens=2, user="h-2")  # `user` names the session too
    before = exhausted_http(pki, p)
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as e:
        oa.chat.completions.create(model="", messages=ask, max_tokens=2, extra_headers={"X-Session-ID": "h-3"})
    assert e.value.status_code == 429 and e.value.code == "max_sessions_per_key"
    assert "max_sessions_per_key" in e.value.message and f"limit {LIMIT}" in e.value.message
    assert exhausted_http(pki, p) == before + 1 and time.monotonic() - t0 < 5  # refused once, not retried
    follow = ask + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And?"}]
    again = oa.chat.completions.create(model="", messages=follow, max_tokens=2, temperature=0,
                                       extra_headers={"X-Session-ID": "h-1"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0               # the existing session goes on
    other = openai_client(pki, p, K_OTHER).completions.create(model="", prompt="Hi", max_tokens=2, user="h-3")
    assert other.usage.completion_tokens == 2
