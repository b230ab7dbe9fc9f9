"""Options of ``kvstack deploy k8s`` and their mapping onto ``K8sOptions``.

Every default is ``K8sOptions``'s, so the command and the Python API render the same
manifests; option values are checked by ``k8s.check_options`` (one ``ConfigError`` line),
not by argparse ``choices``, so a bad value reads like every other kvstack error.
"""

from __future__ import annotations

import argparse
import shlex

from kvstack.core.errors import ConfigError
from kvstack.deploy.k8s_options import DEFAULT_PLAN_CONTEXT, DEFAULT_PLAN_MODEL, K8sOptions
from kvstack.route.policy import ROUTING_POLICIES

D = K8sOptions()
_PLAN_ARGS = (
    "plan_model",
    "plan_gpu",
    "plan_context",
    "plan_kv_cache_dtype",
    "plan_gpu_memory_utilization",
)


def _objects_args(p: argparse.ArgumentParser) -> None:
    """Namespace, name prefix and image of every object."""
    g = p.add_argument_group("objects")
    g.add_argument("--namespace", default=D.namespace, help=f"namespace (default {D.namespace})")
    g.add_argument(
        "--name",
        default=D.name,
        help=f"prefix of every object: NAME-engine, NAME-redis, NAME-router (default {D.name})",
    )
    g.add_argument(
        "--image", default=D.image, help=f"kvstack image, built by deploy/Dockerfile ({D.image})"
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The engine pods: `kvstack serve` replicas and their resources."""
    e = p.add_argument_group("engine (kvstack serve)")
    e.add_argument(
        "--replicas",
        metavar="N",
        type=int,
        default=D.replicas,
        help=f"engine pods (default {D.replicas})",
    )
    e.add_argument("--model", default=None, help="serve --model (default: the image's model)")
    e.add_argument(
        "--port", metavar="PORT", type=int, default=D.port, help=f"HTTP port (default {D.port})"
    )
    e.add_argument("--cpu", default=D.cpu_request, help=f"CPU request (default {D.cpu_request})")
    e.add_argument(
        "--cpu-limit",
        default=D.cpu_limit,
        help=f"CPU limit (default {D.cpu_limit}; 'none' for no limit)",
    )
    e.add_argument(
        "--memory", default=D.memory, help=f"memory request and limit (default {D.memory})"
    )
    e.add_argument(
        "--engine-args",
        action="append",
        metavar="ARGS",
        help="more `kvstack serve` flags, shell-quoted and repeatable, e.g. "
        "--engine-args='--kv-cache-memory 3GiB' (use '=' when ARGS starts with '-')",
    )


def _tier_and_router_args(p: argparse.ArgumentParser) -> None:
    """The Redis KV tier and the router."""
    r = p.add_argument_group("shared KV tier (Redis) and router")
    r.add_argument("--no-redis", action="store_true", help="no Redis tier (no --kv-offload)")
    r.add_argument("--redis-image", default=D.redis_image, help=f"Redis image ({D.redis_image})")
    r.add_argument(
        "--redis-maxmemory",
        default=D.redis_maxmemory,
        help=f"Redis maxmemory, LRU eviction past it (default {D.redis_maxmemory})",
    )
    r.add_argument("--no-router", action="store_true", help="no kvstack router")
    r.add_argument(
        "--router-replicas",
        metavar="N",
        type=int,
        default=D.router_replicas,
        help="router pods (default 1)",
    )
    r.add_argument(
        "--policy",
        default=D.policy,
        help=f"router policy: {', '.join(ROUTING_POLICIES.names())} (default {D.policy})",
    )
    r.add_argument(
        "--cluster-domain",
        default=D.cluster_domain,
        help=f"DNS domain of the headless Service the router resolves ({D.cluster_domain})",
    )


def _autoscaling_args(p: argparse.ArgumentParser) -> None:
    """The KEDA ScaledObject (autoscaling on the KV usage and the queue)."""
    a = p.add_argument_group("autoscaling (KEDA ScaledObject)")
    a.add_argument("--no-keda", action="store_true", help="no ScaledObject: fixed --replicas")
    a.add_argument(
        "--min-replicas", metavar="N", type=int, help="KEDA minimum (default: --replicas)"
    )
    a.add_argument(
        "--max-replicas", metavar="N", type=int, help="KEDA maximum (default: max(8, --replicas))"
    )
    a.add_argument(
        "--prometheus-address",
        default=D.prometheus_address,
        help="URL of the Prometheus KEDA queries (default: the operator's in monitoring)",
    )
    a.add_argument(
        "--kv-usage-threshold",
        metavar="X",
        type=float,
        help="scale out past this max(vllm:kv_cache_usage_perc), in (0, 1] "
        "(default: `kvstack plan`'s suggestion for the --plan-* inputs)",
    )
    a.add_argument(
        "--waiting-threshold",
        metavar="N",
        type=float,
        default=D.waiting_threshold,
        help="target vllm:num_requests_waiting per replica (default 4)",
    )
    a.add_argument(
        "--polling-interval",
        metavar="S",
        type=int,
        default=D.polling_interval,
        help="seconds between KEDA queries (default 15)",
    )
    a.add_argument(
        "--cooldown-period",
        metavar="S",
        type=int,
        default=D.cooldown_period,
        help="KEDA cooldown and HPA scale-down window, seconds (default 300)",
    )


def _planner_args(p: argparse.ArgumentParser) -> None:
    """The `kvstack plan` inputs of the default KV usage threshold."""
    pl = p.add_argument_group("planner inputs for the KV usage threshold (`kvstack plan`)")
    pl.add_argument(
        "--plan-model",
        metavar="MODEL",
        help=f"registry name or config.json (default {DEFAULT_PLAN_MODEL})",
    )
    pl.add_argument(
        "--plan-gpu",
        metavar="GPU",
        help="GPU name or memory size (default: --memory, the engine's memory on CPU)",
    )
    pl.add_argument(
        "--plan-context",
        metavar="TOKENS",
        help=f"max tokens per request (default {DEFAULT_PLAN_CONTEXT})",
    )
    pl.add_argument(
        "--plan-kv-cache-dtype", metavar="DTYPE", help="bf16 (default), fp16, fp8, int8, int4, fp32"
    )
    pl.add_argument(
        "--plan-gpu-memory-utilization", metavar="U", type=float, help="(0, 1], default 0.9"
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    """The PodMonitor and where the YAML goes."""
    m = p.add_argument_group("monitoring and output")
    m.add_argument("--no-podmonitor", action="store_true", help="no Prometheus-operator PodMonitor")
    m.add_argument(
        "--monitor-label",
        action="append",
        metavar="KEY=VALUE",
        help="label the PodMonitor so your Prometheus selects it (e.g. release=kube-prometheus)",
    )
    m.add_argument(
        "--scrape-interval",
        default=D.scrape_interval,
        help=f"PodMonitor scrape interval (default {D.scrape_interval})",
    )
    m.add_argument(
        "--output-dir",
        metavar="DIR",
        help="write one YAML file per component and a kustomization.yaml there, not to stdout",
    )


def add_k8s_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvstack deploy k8s``; every default is ``K8sOptions``'s."""
    for add_group in (
        _objects_args,
        _engine_args,
        _tier_and_router_args,
        _autoscaling_args,
        _planner_args,
        _output_args,
    ):
        add_group(p)


def parse_engine_args(texts: list[str] | None) -> tuple[str, ...]:
    """``--engine-args "--kv-cache-memory 4GiB"`` (repeatable) → shell-split tokens."""
    try:
        return tuple(tok for t in texts or [] for tok in shlex.split(t))
    except ValueError as e:
        raise ConfigError(f"bad --engine-args: {e}") from None


def _labels(texts: list[str] | None) -> tuple[tuple[str, str], ...]:
    out = []
    for t in texts or []:
        key, sep, value = t.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad --monitor-label {t!r}: expected KEY=VALUE")
        out.append((key, value))
    return tuple(out)


def options_from_args(a: argparse.Namespace) -> K8sOptions:
    """``K8sOptions`` from parsed ``kvstack deploy k8s`` arguments."""
    plan_given = [k for k in _PLAN_ARGS if getattr(a, k) is not None]
    if a.kv_usage_threshold is not None and plan_given:
        flag = "--" + plan_given[0].replace("_", "-")
        raise ConfigError(f"give --kv-usage-threshold or {flag}, not both")
    cpu_limit = None if str(a.cpu_limit).lower() in ("", "none") else a.cpu_limit
    plan = {k: getattr(a, k) for k in plan_given}
    return K8sOptions(
        namespace=a.namespace,
        name=a.name,
        image=a.image,
        replicas=a.replicas,
        model=a.model,
        port=a.port,
        cpu_request=a.cpu,
        cpu_limit=cpu_limit,
        memory=a.memory,
        engine_args=parse_engine_args(a.engine_args),
        redis=not a.no_redis,
        redis_image=a.redis_image,
        redis_maxmemory=a.redis_maxmemory,
        router=not a.no_router,
        router_replicas=a.router_replicas,
        policy=a.policy,
        cluster_domain=a.cluster_domain,
        keda=not a.no_keda,
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        prometheus_address=a.prometheus_address,
        kv_usage_threshold=a.kv_usage_threshold,
        waiting_threshold=a.waiting_threshold,
        polling_interval=a.polling_interval,
        cooldown_period=a.cooldown_period,
        podmonitor=not a.no_podmonitor,
        monitor_labels=_labels(a.monitor_label),
        scrape_interval=a.scrape_interval,
        **plan,
    )
