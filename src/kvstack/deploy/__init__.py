"""Deploying kvstack onto existing distributed runtimes, which own placement and scaling.

* ``k8s``: ``kvstack deploy k8s`` renders the Kubernetes manifests (engine Deployment and
  Services, a Redis shared KV tier, the KV-aware router, a KEDA ``ScaledObject`` on the
  planner's threshold, a Prometheus-operator ``PodMonitor``); ``deploy/k8s/`` in the
  repository holds the default rendering.
* ``schemas/``: JSON Schemas, written by the project, of the two custom resources the
  manifests use (KEDA ScaledObject, Prometheus-operator PodMonitor), for the tests.

Kubernetes places, restarts and scales the replicas; kvstack only contributes the choice of
replica per request (``kvstack router``) and the autoscaling signal (its metrics).
"""
