"""TLS and mTLS for specmesh's ports and channels, built from PEM file paths: one place for the
router, the verifier and the drafter services, the `router.register` sidecar and the SDK.

Two settings, each off by default (plaintext, exactly as without this module):
- `ServerTls` — a listening port (gRPC or HTTP): `cert` + `key` turn TLS on; `client_ca` also
  requires every client to present a certificate signed by that CA (mTLS). Flags `--tls-cert`,
  `--tls-key`, `--tls-client-ca` (alias `--tls-ca`); env SPECMESH_TLS_CERT / _KEY / _CLIENT_CA.
- `PeerTls` — channels this process opens to other services (router -> verifier,
  verifier -> drafter, sidecar -> drafter health): `ca` (the CA peers' certificates must chain
  to; empty = the system roots) or a `cert` turns TLS on; `cert` + `key` are presented to peers
  that require mTLS; `server_name` checks peers against that name instead of the dialled host
  (one certificate for a fleet whose pods are dialled by IP). Flags `--peer-ca`, `--peer-cert`,
  `--peer-key`, `--peer-server-name`; env SPECMESH_PEER_CA / _CERT / _KEY / _SERVER_NAME.

- `ClientTls` — a client of the router's public ports (`specmesh generate --endpoint`,
  `specmesh loadtest`): `--tls` (system roots) or `--root-ca`, plus `--client-cert` +
  `--client-key` for a router requiring mTLS; env SPECMESH_ROOT_CA / _CLIENT_CERT / _CLIENT_KEY.

A transport edge, like specmesh.client: it imports grpc and ssl and knows nothing of the engine.
Files are read when credentials are built (at start): a bad path fails the start, naming the flag.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh import service_token

Env = Callable[[str, str], str]


def _read(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{name}: cannot read {path} ({e.strerror or e})") from e


def _check_files(pairs: Sequence[tuple[str, str]]) -> None:
    for name, path in pairs:
        if path and not Path(path).is_file():
            raise ValueError(f"{name}: no such file {path}")


@dataclass(frozen=True)
class ServerTls:
    cert: str = ""       # PEM certificate chain of this server ("" = plaintext)
    key: str = ""        # its PEM private key
    client_ca: str = ""  # PEM CA bundle: clients must present a certificate it signed (mTLS)
    token: str = ""      # shared service token every call must carry (specmesh.service_token)

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mode(self) -> str:
        return "mtls" if self.client_ca else "tls" if self.cert else "off"

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls_cert, tls_key: give both or neither")
        if self.client_ca and not self.cert:
            raise ValueError("tls_client_ca: needs tls_cert and tls_key (client certificates are checked over TLS)")
        _check_files((("tls_cert", self.cert), ("tls_key", self.key), ("tls_client_ca", self.client_ca)))


@dataclass(frozen=True)
class PeerTls:
    ca: str = ""           # PEM CA bundle peers' certificates must chain to ("" = system roots)
    cert: str = ""         # PEM client certificate presented to peers (mTLS)
    key: str = ""          # its PEM private key
    server_name: str = ""  # expected name in peers' certificates ("" = the dialled host)
    token: str = ""        # shared service token sent with every call (specmesh.service_token)

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("peer_cert, peer_key: give both or neither")
        if self.server_name and not self.enabled:
            raise ValueError("peer_server_name: needs peer_ca or peer_cert (it applies to TLS only)")
        _check_files((("peer_ca", self.ca), ("peer_cert", self.cert), ("peer_key", self.key)))


PLAINTEXT_SERVER = ServerTls()
PLAINTEXT_PEER = PeerTls()


# -- gRPC ---------------------------------------------------------------------------------------
def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    assert tls.enabled
    ca = _read(tls.client_ca, "tls_client_ca") if tls.client_ca else None
    return grpc.ssl_server_credentials([(_read(tls.key, "tls_key"), _read(tls.cert, "tls_cert"))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: ServerTls) -> int:
    """`server.add_secure_port` with `tls`, or `add_insecure_port` when it is off; the bound port
    (0 = could not bind)."""
    if tls.enabled:
        return server.add_secure_port(address, server_credentials(tls))
    return server.add_insecure_port(address)


def _check_pair(cert: str | None, key: str | None) -> None:
    if bool(cert) != bool(key):
        raise ValueError("client_cert, client_key: give both or neither")


def channel_credentials(ca: str | None = None, cert: str | None = None,
                        key: str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials from paths: trust `ca` (None = system roots); present `cert` +
    `key` to servers that require mTLS."""
    _check_pair(cert, key)
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "root_ca") if ca else None,
                                        private_key=_read(key, "client_key") if key else None,
                                        certificate_chain=_read(cert, "client_cert") if cert else None)


def peer_channel(address: str, peer: PeerTls, options: Sequence[tuple[str, object]] = (),
                 aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A channel to another service: TLS as `peer` says, else plaintext; every call carries
    `peer.token` when set."""
    opts = list(options)
    extra = {"interceptors": service_token.aio_interceptors(peer.token)} if aio else {}
    mod = grpc.aio if aio else grpc
    if not peer.enabled:
        ch = mod.insecure_channel(address, options=opts, **extra)
    else:
        if peer.server_name:
            opts.append(("grpc.ssl_target_name_override", peer.server_name))
        creds = channel_credentials(peer.ca or None, peer.cert or None, peer.key or None)
        ch = mod.secure_channel(address, creds, options=opts, **extra)
    return ch if aio else service_token.sending(ch, peer.token)


# -- HTTP (aiohttp server, any ssl client) -------------------------------------------------------
def server_ssl_context(tls: ServerTls) -> ssl.SSLContext:
    assert tls.enabled
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca:
        ctx.load_verify_locations(cafile=tls.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """For HTTPS clients of the router (e.g. `openai.DefaultHttpClient(verify=ctx)`)."""
    _check_pair(cert, key)
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


@dataclass(frozen=True)
class ClientTls:
    tls: bool = False
    root_ca: str = ""
    client_cert: str = ""
    client_key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.tls or self.root_ca or self.client_cert or self.client_key)

    def sdk_kwargs(self) -> dict:
        """Keyword arguments of specmesh.client.Client / AsyncClient."""
        return {"tls": self.tls, "root_ca": self.root_ca or None, "client_cert": self.client_cert or None,
                "client_key": self.client_key or None}

    def ssl_context(self) -> ssl.SSLContext | None:
        """For an HTTPS client (None: plaintext, or system roots when only `tls`)."""
        if not (self.root_ca or self.client_cert or self.client_key):
            return None
        return client_ssl_context(self.root_ca or None, self.client_cert or None, self.client_key or None)


# -- flags ---------------------------------------------------------------------------------------
def add_client_args(p: argparse.ArgumentParser, env: Env = os.environ.get) -> None:
    g = p.add_argument_group("TLS to the router (default: plaintext)")
    g.add_argument("--tls", action="store_true", help="TLS, trusting the system roots")
    g.add_argument("--root-ca", default=env("SPECMESH_ROOT_CA", ""), help="PEM CA the router's certificate chains "
                   "to; turns TLS on")
    g.add_argument("--client-cert", default=env("SPECMESH_CLIENT_CERT", ""),
                   help="PEM client certificate, for a router that requires mTLS")
    g.add_argument("--client-key", default=env("SPECMESH_CLIENT_KEY", ""), help="PEM private key of --client-cert")


def client_from_args(a: argparse.Namespace) -> ClientTls:
    return ClientTls(a.tls, a.root_ca, a.client_cert, a.client_key)


def add_server_args(p: argparse.ArgumentParser, env: Env = os.environ.get) -> None:
    g = p.add_argument_group("TLS of the listening port(s) (default: plaintext)")
    g.add_argument("--tls-cert", default=env("SPECMESH_TLS_CERT", ""), help="PEM certificate chain; turns TLS on (env SPECMESH_TLS_CERT)")
    g.add_argument("--tls-key", default=env("SPECMESH_TLS_KEY", ""), help="PEM private key of --tls-cert (env SPECMESH_TLS_KEY)")
    g.add_argument("--tls-client-ca", "--tls-ca", dest="tls_client_ca", default=env("SPECMESH_TLS_CLIENT_CA", ""),
                   help="PEM CA: require client certificates signed by it (mTLS) (env SPECMESH_TLS_CLIENT_CA)")


def add_peer_args(p: argparse.ArgumentParser, env: Env = os.environ.get, what: str = "other services") -> None:
    g = p.add_argument_group(f"TLS of channels to {what} (default: plaintext)")
    g.add_argument("--peer-ca", default=env("SPECMESH_PEER_CA", ""),
                   help="PEM CA the peers' certificates must chain to; turns TLS on (env SPECMESH_PEER_CA)")
    g.add_argument("--peer-cert", default=env("SPECMESH_PEER_CERT", ""),
                   help="PEM client certificate for peers that require mTLS (turns TLS on; without --peer-ca "
                        "peers are checked against the system roots) (env SPECMESH_PEER_CERT)")
    g.add_argument("--peer-key", default=env("SPECMESH_PEER_KEY", ""), help="PEM private key of --peer-cert (env SPECMESH_PEER_KEY)")
    g.add_argument("--peer-server-name", default=env("SPECMESH_PEER_SERVER_NAME", ""),
                   help="name expected in peers' certificates instead of the dialled host (env SPECMESH_PEER_SERVER_NAME)")


def server_from_args(a: dict, token: str = "") -> ServerTls:
    """Pop the flags of add_server_args from `vars(args)`; `token`: the service token to require."""
    return ServerTls(a.pop("tls_cert"), a.pop("tls_key"), a.pop("tls_client_ca"), token)


def peer_from_args(a: dict, token: str = "") -> PeerTls:
    """Pop the flags of add_peer_args from `vars(args)`; `token`: the service token to send."""
    return PeerTls(a.pop("peer_ca"), a.pop("peer_cert"), a.pop("peer_key"), a.pop("peer_server_name"), token)
