"""Deploying kvstack onto existing distributed runtimes, which own placement and scaling.

* ``k8s``: ``kvstack deploy k8s`` renders the Kubernetes manifests (engine Deployment and
  Services, a Redis shared KV tier, the KV-aware router, a KEDA ``ScaledObject`` on the
  planner's threshold, a Prometheus-operator ``PodMonitor``); ``deploy/k8s/`` in the
  repository holds the default rendering. ``k8s`` holds the options (``K8sOptions``) and
  the rendering, ``k8s_objects`` the objects as dicts, ``k8s_cli`` the command's options.
* ``cli``: the ``kvstack deploy`` command (``add_deploy_args``, ``run_deploy``).
* ``schemas/``: JSON Schemas, written by the project, of the two custom resources the
  manifests use (KEDA ScaledObject, Prometheus-operator PodMonitor), for the tests.

Kubernetes places, restarts and scales the replicas; kvstack only contributes the choice of
replica per request (``kvstack router``) and the autoscaling signal (its metrics).

Layer rule: deploy may import the tools (the planner) and route, never ``kvstack.cli``;
modules import downward only: ``cli`` -> ``k8s_cli`` -> ``k8s`` -> ``k8s_objects``.
"""
