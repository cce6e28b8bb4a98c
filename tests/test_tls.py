"""specmesh.tls against real gRPC servers and an HTTPS server on 127.0.0.1 with a throwaway PKI
(tests.certs): TLS accepts a client that trusts the CA and refuses plaintext; mTLS refuses a
client without a certificate or with one from another CA; the peer server-name override; bad
settings fail naming the flag. Services and the router are tested in tests/router/test_router_tls.py."""

from __future__ import annotations

import ssl
import threading
import urllib.error
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh import tls
from tests.certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def servers(pki):
    """Health servers on 127.0.0.1: {"plain", "tls", "mtls"} -> port."""
    started, ports = [], {}
    for name, st in (("plain", tls.ServerTls()), ("tls", tls.ServerTls(pki.server_cert, pki.server_key)),
                     ("mtls", tls.ServerTls(pki.server_cert, pki.server_key, pki.ca))):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        hs = health.HealthServicer()
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        ports[name] = tls.add_port(server, "127.0.0.1:0", st)
        server.start()
        started.append(server)
    yield ports
    for s in started:
        s.stop(0)


def check(port: int, peer: tls.PeerTls) -> grpc.StatusCode:
    with tls.peer_channel(f"127.0.0.1:{port}", peer) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_grpc_tls_and_mtls(pki, servers):
    ok, refused = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE
    trusting = tls.PeerTls(ca=pki.ca)
    with_cert = tls.PeerTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    assert check(servers["plain"], tls.PeerTls()) == ok  # the default: plaintext, as before
    assert check(servers["tls"], trusting) == ok
    assert check(servers["tls"], tls.PeerTls()) == refused                      # plaintext client
    assert check(servers["tls"], tls.PeerTls(ca=pki.rogue_ca)) == refused       # server not trusted
    assert check(servers["mtls"], with_cert) == ok
    assert check(servers["mtls"], trusting) == refused                          # no client certificate
    assert check(servers["mtls"], tls.PeerTls(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key)) == refused
    assert check(servers["mtls"], tls.PeerTls()) == refused


def test_peer_server_name_override(pki, servers):
    assert check(servers["tls"], tls.PeerTls(ca=pki.ca, server_name="localhost")) == grpc.StatusCode.OK
    assert check(servers["tls"], tls.PeerTls(ca=pki.ca, server_name="verifier.example")) == grpc.StatusCode.UNAVAILABLE


def test_https_server_context_requires_client_certificates(pki):
    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Ok)
    httpd.socket = tls.server_ssl_context(tls.ServerTls(pki.server_cert, pki.server_key, pki.ca)).wrap_socket(
        httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{httpd.server_address[1]}/"
    try:
        good = tls.client_ssl_context(pki.ca, pki.client_cert, pki.client_key)
        assert urllib.request.urlopen(url, context=good, timeout=5).read() == b"ok"
        for ctx in (tls.client_ssl_context(pki.ca),                                   # no certificate
                    tls.client_ssl_context(pki.ca, pki.rogue_cert, pki.rogue_key)):   # another CA's
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                urllib.request.urlopen(url, context=ctx, timeout=5).read()
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("settings, flag", [
    (tls.ServerTls(cert="a.pem"), "tls_key"),
    (tls.ServerTls(client_ca="ca.pem"), "tls_client_ca"),
    (tls.ServerTls(cert="/nonexistent/c.pem", key="/nonexistent/k.pem"), "tls_cert"),
    (tls.PeerTls(cert="c.pem"), "peer_key"),
    (tls.PeerTls(server_name="x"), "peer_server_name"),
    (tls.PeerTls(ca="/nonexistent/ca.pem"), "peer_ca"),
])
def test_bad_settings_name_the_flag(settings, flag):
    with pytest.raises(ValueError, match=flag):
        settings.validate()


def test_flags_and_environment(pki):
    import argparse

    p = argparse.ArgumentParser()
    tls.add_server_args(p, env=lambda name, default: {"SPECMESH_TLS_KEY": pki.server_key}.get(name, default))
    tls.add_peer_args(p, env=lambda name, default: default)
    a = vars(p.parse_args(["--tls-cert", pki.server_cert, "--tls-ca", pki.ca, "--peer-ca", pki.ca]))
    assert tls.server_from_args(a) == tls.ServerTls(pki.server_cert, pki.server_key, pki.ca)
    assert tls.peer_from_args(a) == tls.PeerTls(ca=pki.ca)
    assert a == {}


def test_client_flags_for_the_cli_and_the_loadtest(pki):
    """`specmesh generate --endpoint` and `specmesh loadtest`: --tls / --root-ca / --client-cert+key."""
    import argparse

    from loadtest.run import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    tls.add_client_args(p, env=lambda name, default: {"SPECMESH_ROOT_CA": pki.ca}.get(name, default))
    c = tls.client_from_args(p.parse_args(["--client-cert", pki.client_cert, "--client-key", pki.client_key]))
    assert c == tls.ClientTls(False, pki.ca, pki.client_cert, pki.client_key) and c.enabled
    assert c.sdk_kwargs() == {"tls": False, "root_ca": pki.ca, "client_cert": pki.client_cert,
                              "client_key": pki.client_key}
    assert isinstance(c.ssl_context(), ssl.SSLContext)
    assert tls.ClientTls().ssl_context() is None and not tls.ClientTls().enabled
    assert tls.ClientTls(tls=True).ssl_context() is None  # system roots: the HTTP client's default
    with pytest.raises(ValueError, match="client_cert, client_key"):
        tls.ClientTls(client_cert=pki.client_cert).ssl_context()
    lp = argparse.ArgumentParser()
    add_arguments(lp)
    cfg = config_from_args(lp.parse_args(["--target-url", "https://127.0.0.1:8000", "--root-ca", pki.ca]))
    assert cfg.tls == tls.ClientTls(root_ca=pki.ca)
