"""``kvstack deploy k8s``: Kubernetes manifests for kvstack replicas behind its router.

Components (one YAML file each under ``--output-dir``; ``deploy/k8s/`` is the default):

* ``engine.yaml``: Deployment of ``kvstack serve`` pods, a ClusterIP Service, and a headless
  Service (``clusterIP: None``) whose DNS A records are the *ready* pods' IPs, which the
  router re-resolves (``--discover-dns``) to find its replicas.
* ``redis.yaml``: one Redis, a pure LRU cache (no snapshots), the shared KV tier every
  engine reads and writes (``--kv-offload redis://NAME-redis:6379``).
* ``router.yaml``: ``kvstack router`` and its Service, the OpenAI entry point.
* ``scaledobject.yaml``: KEDA scales the engine Deployment on two Prometheus queries,
  ``max(vllm:kv_cache_usage_perc)`` against the planner's threshold
  (``kvstack.tools.plan``: the usage at which one more max-context request no longer fits,
  clamped to [0.5, 0.9]) and ``sum(vllm:num_requests_waiting)`` per replica.
* ``podmonitor.yaml``: the Prometheus-operator scrapes every engine pod's and the router's
  ``/metrics``.

Kubernetes owns placement, scaling and restarts (llm-d's and the Gateway API Inference
Extension's split); the router only picks a replica per request. Invariants: every
Service and Deployment selector equals its pods' selector labels; the engine's
``terminationGracePeriodSeconds`` exceeds preStop + ``--shutdown-grace`` + uvicorn's margin,
so SIGTERM drains in-flight requests before SIGKILL; rendering is deterministic (the
checked-in ``deploy/k8s/`` must equal ``render_files(K8sOptions())``).

Autoscaling defaults: the image runs on CPU, so the planner's "GPU memory" is the engine
pod's memory limit (4Gi), with the default model's shapes (``smollm2-135m``) at its full
context (8192 tokens) in bf16: one request is 189 MB of a 2.52 GB KV budget (0.9 × 4 GiB −
weights − 1 GiB reserve), 1 − 0.075 = 0.925, so the planner answers its upper clamp, 0.9.
``--plan-*`` or ``--kv-usage-threshold`` change it; the ScaledObject's
``kvstack/kv-usage-threshold-source`` annotation records the ``kvstack plan`` command used.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvstack.core.errors import ConfigError
from kvstack.deploy.k8s_objects import render_components
from kvstack.deploy.k8s_options import DEFAULT_PLAN_MODEL, K8sOptions
from kvstack.route.policy import ROUTING_POLICIES
from kvstack.tools.plan import make_plan, parse_tokens, resolve_gpu, resolve_model

Manifest = dict[str, Any]

CRD_SCHEMAS = {"ScaledObject": "scaledobject.schema.json", "PodMonitor": "podmonitor.schema.json"}
HEADER = (
    "# Rendered by `kvstack deploy k8s` (src/kvstack/deploy/k8s.py): change the options and\n"
    "# re-render instead of editing; deploy/k8s/ is checked against the default rendering.\n"
)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_REDIS_SIZE = re.compile(r"^[0-9]+(b|k|kb|m|mb|g|gb)?$", re.IGNORECASE)
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h)$")
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
_LONGEST_SUFFIX = "-engine-headless"  # the longest object name derived from --name


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_options(o: K8sOptions) -> None:
    """Raise one ``ConfigError`` line for the first bad option."""
    _check(
        bool(_DNS1035.match(o.name)) and len(o.name) + len(_LONGEST_SUFFIX) <= 63,
        f"--name {o.name!r} must be a DNS-1035 label (lowercase letters, digits, '-', starting "
        f"with a letter) of at most {63 - len(_LONGEST_SUFFIX)} characters",
    )
    _check(
        bool(_DNS1123.match(o.namespace)) and len(o.namespace) <= 63,
        f"--namespace {o.namespace!r} must be a DNS-1123 label (lowercase letters, digits, '-')",
    )
    for what, image in (("--image", o.image), ("--redis-image", o.redis_image)):
        _check(bool(image) and not any(c.isspace() for c in image), f"bad {what} {image!r}")
    _check(o.replicas >= 1, f"--replicas must be at least 1, got {o.replicas}")
    _check(o.router_replicas >= 1, f"--router-replicas must be at least 1, got {o.router_replicas}")
    _check(0 < o.port < 65536, f"--port must be in 1..65535, got {o.port}")
    _check(
        o.policy in ROUTING_POLICIES,
        f"unknown --policy {o.policy!r}; choose from {', '.join(ROUTING_POLICIES.names())}",
    )
    _check(o.model is None or bool(o.model.strip()), "--model must not be empty")
    for what, q in (("--cpu", o.cpu_request), ("--cpu-limit", o.cpu_limit), ("--memory", o.memory)):
        _check(q is None or bool(_QUANTITY.match(q)), f"bad {what} {q!r} (examples: 2, 500m, 6Gi)")
    _check(
        bool(_REDIS_SIZE.match(o.redis_maxmemory)),
        f"bad --redis-maxmemory {o.redis_maxmemory!r} (Redis units, e.g. 2gb, 512mb)",
    )
    _check(bool(_SUBDOMAIN.match(o.cluster_domain)), f"bad --cluster-domain {o.cluster_domain!r}")
    _check(o.scale_min >= 1, f"--min-replicas must be at least 1, got {o.scale_min}")
    _check(
        o.scale_min <= o.replicas <= o.scale_max,
        f"need --min-replicas ({o.scale_min}) <= --replicas ({o.replicas}) <= --max-replicas "
        f"({o.scale_max})",
    )
    t = o.kv_usage_threshold
    _check(t is None or 0 < t <= 1, f"--kv-usage-threshold must be in (0, 1], got {t}")
    _check(o.waiting_threshold > 0, f"--waiting-threshold must be > 0, got {o.waiting_threshold}")
    _check(o.polling_interval >= 1, f"--polling-interval must be >= 1, got {o.polling_interval}")
    _check(
        0 <= o.cooldown_period <= 3600,
        f"--cooldown-period must be in 0..3600 (the HPA's limit), got {o.cooldown_period}",
    )
    _check(
        o.prometheus_address.startswith(("http://", "https://")),
        f"--prometheus-address must be an http(s) URL, got {o.prometheus_address!r}",
    )
    _check(bool(_DURATION.match(o.scrape_interval)), f"bad --scrape-interval {o.scrape_interval!r}")
    for key, value in o.monitor_labels:
        _check(
            bool(_LABEL_KEY.match(key)) and bool(_LABEL_VALUE.match(value)) and len(value) <= 63,
            f"bad --monitor-label {key}={value} (Kubernetes label key and value)",
        )
    managed = ["--host", "--port", "--shutdown-grace", "--model"]
    managed += ["--kv-offload"] if o.redis else []
    for arg in o.engine_args:
        flag = arg.split("=", 1)[0]
        _check(
            flag not in managed,
            f"--engine-args must not set {flag}: the manifests set it (use the deploy option)",
        )


def plan_command(o: K8sOptions) -> str:
    """The ``kvstack plan`` command whose ``scale out when`` figure the ScaledObject uses."""
    gpu = o.plan_gpu or o.memory
    return (
        f"kvstack plan --model {o.plan_model or DEFAULT_PLAN_MODEL} --gpu {gpu} "
        f"--context {o.plan_context} --kv-cache-dtype {o.plan_kv_cache_dtype} "
        f"--gpu-memory-utilization {o.plan_gpu_memory_utilization:g}"
    )


def kv_usage_threshold(o: K8sOptions) -> tuple[float, str]:
    """(threshold, where it came from): the option, or ``make_plan``'s suggestion."""
    if o.kv_usage_threshold is not None:
        return o.kv_usage_threshold, "--kv-usage-threshold"
    if o.model is not None and o.plan_model is None:
        raise ConfigError(
            f"--model {o.model}: give --plan-model (the planner's name or config.json for it) "
            "or --kv-usage-threshold, so the autoscaling threshold fits that model"
        )
    try:
        plan = make_plan(
            resolve_model(o.plan_model or DEFAULT_PLAN_MODEL),
            resolve_gpu(o.plan_gpu or o.memory),
            parse_tokens(o.plan_context),
            kv_cache_dtype=o.plan_kv_cache_dtype,
            gpu_memory_utilization=o.plan_gpu_memory_utilization,
        )
    except ConfigError as e:
        raise ConfigError(f"planner inputs (--plan-*): {e}") from None
    if plan.autoscale_kv_usage_threshold is None:
        raise ConfigError(
            f"`{plan_command(o)}` fits no max-context request, so it suggests no threshold: "
            "give a larger --plan-gpu, a smaller --plan-context, or --kv-usage-threshold"
        )
    return plan.autoscale_kv_usage_threshold, plan_command(o)


def _components(o: K8sOptions) -> dict[str, list[Manifest]]:
    check_options(o)
    threshold, source = kv_usage_threshold(o) if o.keda else (0.0, "")
    return render_components(o, threshold, source)


def render_manifests(o: K8sOptions) -> list[Manifest]:
    """Every object, in apply order (Redis, engine, router, ScaledObject, PodMonitor)."""
    return [doc for docs in _components(o).values() for doc in docs]


def dump_yaml(docs: list[Manifest]) -> str:
    """Multi-document YAML, keys in insertion order, long strings never folded."""
    return str(yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True, width=4096, indent=2))


def render_yaml(o: K8sOptions) -> str:
    """All manifests as one multi-document YAML stream (what ``kvstack deploy k8s`` prints)."""
    return HEADER + dump_yaml(render_manifests(o))


def render_files(o: K8sOptions) -> dict[str, str]:
    """``{file name: YAML}``: one file per component plus a ``kustomization.yaml`` of them."""
    files = {f"{comp}.yaml": HEADER + dump_yaml(docs) for comp, docs in _components(o).items()}
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(files),
    }
    files["kustomization.yaml"] = HEADER + dump_yaml([kustomization])
    return files


def write_files(o: K8sOptions, out_dir: str | Path) -> list[Path]:
    """Write ``render_files(o)`` into ``out_dir`` (created); other files there are kept."""
    out = Path(out_dir)
    paths = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for fname, text in render_files(o).items():
            (out / fname).write_text(text, encoding="utf-8")
            paths.append(out / fname)
    except OSError as e:
        raise ConfigError(f"cannot write --output-dir {str(out)!r}: {e}") from None
    return paths


def crd_schema(kind: str) -> dict[str, Any]:
    """The project's JSON Schema of a custom resource kind (``ScaledObject``, ``PodMonitor``)."""
    if kind not in CRD_SCHEMAS:
        raise ConfigError(f"no schema for kind {kind!r}; known: {', '.join(CRD_SCHEMAS)}")
    text = resources.files("kvstack.deploy").joinpath("schemas", CRD_SCHEMAS[kind]).read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema
