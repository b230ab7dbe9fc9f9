"""``K8sOptions``: everything ``kvstack deploy k8s`` renders from, with the names it derives.

``deploy/k8s.py`` validates the options (``check_options``) and renders the manifests;
``deploy/k8s_objects.py`` builds each object from them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PLAN_MODEL = "smollm2-135m"  # registry twin of the default model's shapes
DEFAULT_PLAN_CONTEXT = 8192  # SmolLM2's max_position_embeddings = serve's max-model-len


@dataclass(frozen=True)
class K8sOptions:
    """Everything the manifests depend on; ``render_manifests`` validates it first."""

    namespace: str = "default"
    name: str = "kvstack"  # prefix of every object: NAME-engine, NAME-redis, NAME-router
    image: str = "kvstack:0.1.0"  # built by deploy/Dockerfile
    replicas: int = 2  # engine pods at first; KEDA then keeps them in [min, max]
    model: str | None = None  # kvstack serve --model; None = the default model in the image
    port: int = 8000
    cpu_request: str = "2"
    cpu_limit: str | None = "4"
    memory: str = "4Gi"  # engine request = limit: 2 GiB KV pool, weights, torch
    engine_args: tuple[str, ...] = ()  # extra `kvstack serve` flags, e.g. --kv-cache-memory
    redis: bool = True
    redis_image: str = "redis:7"
    redis_maxmemory: str = "2gb"
    router: bool = True
    router_replicas: int = 1
    policy: str = "kv_events"
    cluster_domain: str = "cluster.local"
    keda: bool = True
    min_replicas: int | None = None  # None = replicas
    max_replicas: int | None = None  # None = max(8, replicas)
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"
    kv_usage_threshold: float | None = None  # None = the planner's
    waiting_threshold: float = 4.0  # waiting requests per replica
    polling_interval: int = 15
    cooldown_period: int = 300
    plan_model: str | None = None  # None = DEFAULT_PLAN_MODEL (only with model=None)
    plan_gpu: str | None = None  # None = the engine pod's memory (CPU image)
    plan_context: int | str = DEFAULT_PLAN_CONTEXT
    plan_kv_cache_dtype: str = "bf16"
    plan_gpu_memory_utilization: float = 0.9
    podmonitor: bool = True
    monitor_labels: tuple[tuple[str, str], ...] = ()  # e.g. (("release", "kube-prom"),)
    scrape_interval: str = "15s"

    @property
    def engine_name(self) -> str:
        return f"{self.name}-engine"

    @property
    def headless_name(self) -> str:
        return f"{self.name}-engine-headless"

    @property
    def redis_name(self) -> str:
        return f"{self.name}-redis"

    @property
    def router_name(self) -> str:
        return f"{self.name}-router"

    @property
    def scale_min(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def scale_max(self) -> int:
        return max(8, self.replicas) if self.max_replicas is None else self.max_replicas

    @property
    def discover_dns(self) -> str:
        """HOST:PORT the router re-resolves: the headless Service's fully qualified name."""
        host = f"{self.headless_name}.{self.namespace}.svc.{self.cluster_domain}"
        return f"{host}:{self.port}"
