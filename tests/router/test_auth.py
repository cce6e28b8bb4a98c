"""API keys, key ids, session scoping and the sessions-per-key decision (router.auth; pure, no Redis)."""

from __future__ import annotations

import grpc
import pytest

from router.auth import Auth, key_id, scoped_session
from router.config import RouterConfig
from router.errors import NO_RETRY, Kind, RouterError

KEYS = ("k-alpha-0123456789abcdef", "k-beta-fedcba9876543210")


def auth(keys: tuple[str, ...] = KEYS, limit: int = 0) -> Auth:
    return Auth.from_config(RouterConfig(api_keys=keys, max_sessions_per_key=limit, session_ttl_s=90))


@pytest.mark.parametrize("header", [
    None,                                  # no header at all
    "",
    "Bearer",                              # no key
    "Bearer ",
    "Bearer wrong-key",
    f"Bearer {KEYS[0]}x",                  # a configured key with more after it
    f"Bearer {KEYS[0][:-1]}",              # a configured key's beginning
    f"Basic {KEYS[0]}",                    # a configured key under another scheme
    KEYS[0],                               # no scheme
])
def test_a_wrong_key_is_refused(header):
    with pytest.raises(RouterError) as e:
        auth().authenticate(header)
    assert e.value.kind is Kind.UNAUTHENTICATED
    assert e.value.grpc_status == grpc.StatusCode.UNAUTHENTICATED and e.value.http_status == 401
    assert e.value.message == "authorization: a valid API key is required (Bearer KEY)"


@pytest.mark.parametrize("header, key", [
    (f"Bearer {KEYS[0]}", KEYS[0]),
    (f"Bearer {KEYS[1]}", KEYS[1]),        # any configured key
    (f"bearer {KEYS[0]}", KEYS[0]),        # the scheme in any case
    (f"Bearer  {KEYS[1]} ", KEYS[1]),      # spaces around the key
])
def test_the_right_key_is_accepted_as_its_id(header, key):
    assert auth().authenticate(header) == key_id(key)


@pytest.mark.parametrize("header", [None, "", "Bearer anything", "Basic x"])
def test_no_keys_configured_is_open(header):
    assert auth(keys=()).authenticate(header) == ""


def test_key_ids_do_not_reveal_the_key():
    ids = [key_id(k) for k in KEYS]
    assert ids == [key_id(k) for k in KEYS]              # stable: Redis keys and quotas are named by it
    assert len(set(ids)) == len(KEYS)                    # one id per key
    for k, i in zip(KEYS, ids, strict=True):
        assert len(i) == 16 and set(i) <= set("0123456789abcdef")  # a short hex digest ...
        assert i not in k and k not in i and k[:8] not in i  # ... holding no part of the key


def test_session_ids_are_scoped_per_key():
    a, b = key_id(KEYS[0]), key_id(KEYS[1])
    assert scoped_session(a, "s") != scoped_session(b, "s")      # same id, two keys: two sessions
    assert scoped_session(a, "s") != scoped_session(a, "t")
    assert scoped_session(a, "s").endswith("/s") and KEYS[0] not in scoped_session(a, "s")
    assert scoped_session("", "s") == "s"                        # no keys: the client's id as is
    assert scoped_session(a, "") == ""                           # one-shot stays one-shot


@pytest.mark.parametrize("limit, key, session_id, counted", [
    (2, "kid", "s", True),
    (0, "kid", "s", False),      # no limit configured: nothing is counted
    (2, "kid", "", False),       # one-shot requests keep no state
    (2, "", "s", False),         # no key, nothing to count under
])
def test_which_sessions_count_against_the_key(limit, key, session_id, counted):
    assert auth(limit=limit).counts(key, session_id) is counted


def test_over_quota_is_final_429_naming_the_limit():
    e = auth(limit=3).over_quota(3)
    assert e.kind is Kind.EXHAUSTED and e.http_status == 429 and e.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.final and NO_RETRY in e.headers                  # clients must not retry it soon
    assert e.code == "max_sessions_per_key"
    assert e.message.startswith("max_sessions_per_key: this API key already has 3 live sessions (limit 3)")
    assert "90 s after its last turn" in e.message
