"""The Kubernetes objects of ``kvstack deploy k8s`` as plain dicts (validated options in).

Probes follow the server: ``GET /health`` answers 200 once the model is loaded and the
engine loop runs, 503 when the loop has died. The engine's first start also compiles the C++
kernels (``kvstack.model.kernels.loader``, 30-60 s, cached in an ``emptyDir`` that survives
container restarts), so a ``startupProbe`` allows 3 minutes before the liveness probe
takes over. On SIGTERM ``kvstack serve`` stops accepting and lets in-flight requests finish
for ``--shutdown-grace`` seconds; the preStop sleep first lets
endpoints and the headless DNS drop the pod, and the grace period covers both.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstack.deploy.k8s_options import K8sOptions

Manifest = dict[str, Any]

SHUTDOWN_GRACE_S = 30  # kvstack serve --shutdown-grace (its default)
UVICORN_MARGIN_S = 5  # serve's timeout_graceful_shutdown = grace + 5
PRESTOP_SLEEP_S = 5
TERMINATION_GRACE_S = PRESTOP_SLEEP_S + SHUTDOWN_GRACE_S + UVICORN_MARGIN_S + 10
KERNEL_DIR = "/var/cache/kvstack"  # $KVSTACK_KERNEL_DIR, an emptyDir
RUN_AS = 10001  # the image's `kvstack` user (deploy/Dockerfile)
REDIS_PORT = 6379
_REDIS_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 10**6, "mb": 1024**2}
_REDIS_UNITS |= {"g": 10**9, "gb": 1024**3}
# A cache, not a store: no RDB snapshots, no AOF; reachable only in-cluster (NetworkPolicy).
REDIS_ARGS = ("redis-server", "--save", "", "--appendonly", "no", "--protected-mode", "no")


def selector(o: K8sOptions, component: str) -> dict[str, str]:
    """The labels a component's Deployment, Services and monitors select on (immutable)."""
    return {
        "app.kubernetes.io/name": "kvstack",
        "app.kubernetes.io/instance": o.name,
        "app.kubernetes.io/component": component,
    }


def labels(o: K8sOptions, component: str) -> dict[str, str]:
    return selector(o, component) | {
        "app.kubernetes.io/part-of": "kvstack",
        "app.kubernetes.io/managed-by": "kvstack-deploy",
    }


def _meta(o: K8sOptions, name: str, component: str, **extra: Any) -> Manifest:
    return {"name": name, "namespace": o.namespace, "labels": labels(o, component), **extra}


def _http_probe(period: int, failures: int, delay: int = 0) -> Manifest:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "initialDelaySeconds": delay,
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _cpu_threads(quantity: str) -> int:
    """Whole cores of a CPU quantity (``2`` → 2, ``500m`` → 1): torch's OpenMP threads."""
    cores = float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
    return max(1, math.floor(cores))


def _redis_bytes(size: str) -> int:
    digits = size.rstrip("bBkKmMgG")
    return int(digits) * _REDIS_UNITS[size[len(digits) :].lower()]


def _deployment(
    o: K8sOptions, name: str, component: str, replicas: int, pod: Manifest, **spec: Any
) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(o, name, component),
        "spec": {
            "replicas": replicas,
            **spec,
            "selector": {"matchLabels": selector(o, component)},
            "template": {"metadata": {"labels": labels(o, component)}, "spec": pod},
        },
    }


def _service(
    o: K8sOptions, name: str, component: str, port: int, port_name: str, headless: bool = False
) -> Manifest:
    spec: Manifest = {"type": "ClusterIP"}
    if headless:  # A records = ready pods only, re-resolved by the router
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": False}
    spec |= {
        "selector": selector(o, component),
        "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(o, name, component),
        "spec": spec,
    }


def _kvstack_container(o: K8sOptions, name: str, args: list[str], resources: Manifest) -> Manifest:
    return {
        "name": name,
        "image": o.image,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        "ports": [{"name": "http", "containerPort": o.port, "protocol": "TCP"}],
        "resources": resources,
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _kvstack_pod(o: K8sOptions, container: Manifest, component: str, **extra: Any) -> Manifest:
    return {
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS},
        "topologySpreadConstraints": [
            {  # spread replicas over nodes when the scheduler can; never block scheduling
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector(o, component)},
            }
        ],
        "containers": [container],
        **extra,
    }


def engine_objects(o: K8sOptions) -> list[Manifest]:
    args = ["serve", "--host", "0.0.0.0", "--port", str(o.port)]
    if o.redis:
        args += ["--kv-offload", f"redis://{o.redis_name}:{REDIS_PORT}"]
    args += ["--shutdown-grace", str(SHUTDOWN_GRACE_S)]
    args += ["--model", o.model] if o.model is not None else []
    args += list(o.engine_args)
    limits = {"memory": o.memory} | ({"cpu": o.cpu_limit} if o.cpu_limit else {})
    resources = {"requests": {"cpu": o.cpu_request, "memory": o.memory}, "limits": limits}
    container = _kvstack_container(o, "engine", args, resources)
    container |= {
        "env": [
            {"name": "KVSTACK_KERNEL_DIR", "value": KERNEL_DIR},
            {"name": "OMP_NUM_THREADS", "value": str(_cpu_threads(o.cpu_request))},
        ],
        "startupProbe": _http_probe(period=5, failures=36, delay=5),
        "readinessProbe": _http_probe(period=5, failures=2),
        "livenessProbe": _http_probe(period=10, failures=3),
        "volumeMounts": [{"name": "kernel-cache", "mountPath": KERNEL_DIR}],
    }
    pod = _kvstack_pod(o, container, "engine", volumes=[{"name": "kernel-cache", "emptyDir": {}}])
    surge = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return [
        _deployment(o, o.engine_name, "engine", o.replicas, pod, strategy=surge),
        _service(o, o.engine_name, "engine", o.port, "http"),
        _service(o, o.headless_name, "engine", o.port, "http", headless=True),
    ]


def redis_objects(o: K8sOptions) -> list[Manifest]:
    """A pure cache: no RDB/AOF, LRU eviction past maxmemory (as scripts/redis.sh); its
    memory limit leaves 25 % + 128 MiB over maxmemory for Redis' own overhead."""
    memory = math.ceil((_redis_bytes(o.redis_maxmemory) * 1.25 + 128 * 2**20) / 2**20)
    container = {
        "name": "redis",
        "image": o.redis_image,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            *REDIS_ARGS,
            "--maxmemory",
            o.redis_maxmemory,
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "exec": {"command": ["redis-cli", "ping"]},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "tcpSocket": {"port": "redis"},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {"cpu": "250m", "memory": f"{memory}Mi"},
            "limits": {"memory": f"{memory}Mi"},
        },
    }
    pod = {"containers": [container]}
    instance = {k: v for k, v in selector(o, "redis").items() if k != "app.kubernetes.io/component"}
    policy = {  # no auth on this Redis: only this instance's pods may connect
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(o, o.redis_name, "redis"),
        "spec": {
            "podSelector": {"matchLabels": selector(o, "redis")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": instance}}],
                    "ports": [{"protocol": "TCP", "port": REDIS_PORT}],
                }
            ],
        },
    }
    return [
        _deployment(o, o.redis_name, "redis", 1, pod, strategy={"type": "Recreate"}),
        _service(o, o.redis_name, "redis", REDIS_PORT, "redis"),
        policy,
    ]


def router_objects(o: K8sOptions) -> list[Manifest]:
    """``kvstack router``: readiness on ``/health`` (503 while no backend can serve), liveness
    on the open port only, so engines that are still starting never get the router killed.
    ``--model`` matches the engines' so prompts hash into the same block chain."""
    args = ["router", "--host", "0.0.0.0", "--port", str(o.port), "--policy", o.policy]
    args += ["--discover-dns", o.discover_dns, "--shutdown-grace", str(SHUTDOWN_GRACE_S)]
    args += ["--model", o.model] if o.model is not None else []
    resources = {
        "requests": {"cpu": "500m", "memory": "512Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    }
    container = _kvstack_container(o, "router", args, resources)
    container |= {
        "readinessProbe": _http_probe(period=5, failures=2, delay=2),
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
    }
    pod = _kvstack_pod(o, container, "router")
    return [
        _deployment(o, o.router_name, "router", o.router_replicas, pod),
        _service(o, o.router_name, "router", o.port, "http"),
    ]


def _number(x: float) -> str:
    return f"{x:g}"


def scaled_object(o: K8sOptions, threshold: float, source: str) -> Manifest:
    """KEDA scales the engine on the hottest replica's KV usage and the waiting queue.

    ``metricType: Value`` for the KV usage: the HPA wants ``ceil(replicas × max / threshold)``
    replicas, i.e. a utilization target on the fullest pool. ``AverageValue`` for the queue:
    ``ceil(sum(waiting) / threshold)`` replicas, one per ``threshold`` waiting requests. The
    HPA takes the larger; scale-down is slow (each removed pod loses its device cache).
    """
    match = f'{{namespace="{o.namespace}",pod=~"{o.engine_name}-.+"}}'

    def trigger(name: str, query: str, target: float, metric_type: str) -> Manifest:
        return {
            "type": "prometheus",
            "name": name,
            "metricType": metric_type,
            "metadata": {
                "serverAddress": o.prometheus_address,
                "query": query,
                "threshold": _number(target),
            },
        }

    annotations = {"kvstack/kv-usage-threshold-source": source}
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(o, o.engine_name, "engine", annotations=annotations),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": o.engine_name,
            },
            "pollingInterval": o.polling_interval,
            "cooldownPeriod": o.cooldown_period,
            "minReplicaCount": o.scale_min,
            "maxReplicaCount": o.scale_max,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {
                            "stabilizationWindowSeconds": o.cooldown_period,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                        }
                    }
                }
            },
            "triggers": [
                trigger(
                    "kv-cache-usage", f"max(vllm:kv_cache_usage_perc{match})", threshold, "Value"
                ),
                trigger(
                    "requests-waiting",
                    f"sum(vllm:num_requests_waiting{match})",
                    o.waiting_threshold,
                    "AverageValue",
                ),
            ],
        },
    }


def pod_monitor(o: K8sOptions, component: str) -> Manifest:
    """Scrape a component's pods: the engines (what KEDA queries) or the router."""
    meta = _meta(o, f"{o.name}-{component}", component)
    meta["labels"] |= dict(o.monitor_labels)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector(o, component)},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": o.scrape_interval}
            ],
        },
    }


def render_components(o: K8sOptions, threshold: float, source: str) -> dict[str, list[Manifest]]:
    """``{component: objects}`` in apply order; components switched off are absent."""
    out: dict[str, list[Manifest]] = {}
    if o.redis:
        out["redis"] = redis_objects(o)
    out["engine"] = engine_objects(o)
    if o.router:
        out["router"] = router_objects(o)
    if o.keda:
        out["scaledobject"] = [scaled_object(o, threshold, source)]
    if o.podmonitor:
        out["podmonitor"] = [pod_monitor(o, "engine")]
        out["podmonitor"] += [pod_monitor(o, "router")] if o.router else []
    return out
