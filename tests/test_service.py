"""The services' shared layer (specmesh.service): the router, the verifier and the drafter service
declare their settings one way, share the common flags with the same names, help and defaults,
read an environment variable for every flag, and refuse a bad value naming the setting."""

from __future__ import annotations

import argparse

import pytest

from drafter_service.config import DrafterServiceConfig
from router.config import RouterConfig
from specmesh.service import env_name
from verifier_service.config import VerifierConfig

SERVICES = {"router": RouterConfig, "verifier": VerifierConfig, "drafter": DrafterServiceConfig}
COMMON = ("--host", "--port", "--grace-s", "--log-level", "--tls-cert", "--tls-key", "--tls-client-ca",
          "--service-token")
MODEL = ("--threads", "--device", "--dtype", "--metrics-port")  # services that run a model
NO_ENV = {"--help", "--no-pipelining", "--drafter"}  # an alias, and the verifier's deprecated name


def _options(cls) -> dict[str, argparse.Action]:
    return {o: a for a in cls.parser()._actions for o in a.option_strings if o.startswith("--")}


def _help(action: argparse.Action) -> str:
    return action.help or ""


@pytest.mark.parametrize("flags,services", [(COMMON, ("router", "verifier", "drafter")),
                                            (MODEL, ("verifier", "drafter"))])
def test_common_flags_have_one_name_help_and_default(flags, services, monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("SPECMESH_")]:
        monkeypatch.delenv(k)
    options = {s: _options(SERVICES[s]) for s in services}
    for flag in flags:
        seen = {(options[s][flag].dest, _help(options[s][flag]), options[s][flag].default) for s in services}
        assert len(seen) == 1, (flag, seen)


@pytest.mark.parametrize("service", SERVICES)
def test_every_flag_reads_its_environment_variable(service):
    """Every flag's help names SPECMESH_<FLAG>, the variable its default comes from."""
    for flag, action in _options(SERVICES[service]).items():
        if flag in NO_ENV or flag == "--tls-ca":  # --tls-ca: the old name of --tls-client-ca
            continue
        want = "SPECMESH_API_KEYS" if flag == "--api-key" else env_name(flag)
        assert want in _help(action), (service, flag, action.help)


@pytest.mark.parametrize("service", SERVICES)
def test_environment_sets_a_setting_and_a_flag_wins(service, monkeypatch):
    cls = SERVICES[service]
    monkeypatch.setenv("SPECMESH_GRACE_S", "7.5")
    monkeypatch.setenv("SPECMESH_LOG_LEVEL", "info")
    cfg = cls.from_args([])
    assert (cfg.grace_s, cfg.log_level) == (7.5, "INFO")
    assert cls.from_args(["--grace-s", "1"]).grace_s == 1.0


@pytest.mark.parametrize("service,argv,field", [
    ("router", ["--port", "70000"], "port"),
    ("verifier", ["--port", "-1"], "port"),
    ("drafter", ["--metrics-port", "65536"], "metrics_port"),
    ("verifier", ["--threads", "0"], "threads"),
    ("drafter", ["--grace-s", "-1"], "grace_s"),
    ("verifier", ["--tree-budget", "65"], "budget"),
    ("verifier", ["--depth", "0"], "depth"),
    ("router", ["--max-tokens", "0"], "max_tokens"),
    ("drafter", ["--max-streams", "0"], "max_streams"),
    ("drafter", ["--drafter", "model:x.gguf", "--draft-vocab", "-1"], "draft_vocab"),
    ("drafter", ["--draft-vocab", "4096"], "draft_vocab"),  # an ngram drafter has no head
])
def test_a_bad_setting_exits_naming_it(service, argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        SERVICES[service].from_args(argv)
    assert e.value.code == 2
    assert f"{field}:" in capsys.readouterr().err


def test_a_bad_value_from_the_environment_is_refused_too(monkeypatch, capsys):
    """argparse does not check `choices` against a default; validate() does."""
    monkeypatch.setenv("SPECMESH_DTYPE", "fp8")
    with pytest.raises(SystemExit):
        VerifierConfig.from_args([])
    assert "dtype:" in capsys.readouterr().err


def test_the_routers_settings_do_not_load_torch():
    """The router runs no model: parsing its flags must not pull in torch (startup, memory)."""
    import subprocess
    import sys

    code = "import sys; from router.config import RouterConfig; RouterConfig.from_args([]); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
