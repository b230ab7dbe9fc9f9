"""``kvstack serve --ray --replicas N``: the engine as a Ray Serve deployment.

Locally this starts a Ray instance of its own; ``--ray-address auto`` joins a running
cluster instead (``ray start --head`` on one node and ``ray start --address ...`` on the
others, or a KubeRay ``RayCluster``/``RayService``): the same deployment then places its
replicas on any node with free CPUs, and each replica serves its event stream on its
node's address (``--replica-host 0.0.0.0``). Ray owns placement, scaling and restarts;
kvstack's routing policy only picks the replica.

* ``config``: ``RayOptions`` (the ``--ray`` flags);
* ``app``: ``build_ray_app`` / ``serve_on_ray`` (deploy, block until a signal);
* ``replica``: ``EngineReplica``, one ``kvstack serve`` app inside a Ray replica, built
  from the ``EngineConfig`` and ``ServerOptions`` it is bound with;
* ``router``: ``KVRequestRouter``, Ray Serve's ``RequestRouter`` asking a kvstack policy;
* ``ingress``: the OpenAI front that tokenizes and calls the engine handle;
* ``state``: this process's routers, for ``GET /router/state``.

Importing this package (or ``config`` / ``app``) does not import Ray: ``kvstack --help``
must not pay for it. ``replica``, ``router`` and ``ingress`` import Ray.
"""

from __future__ import annotations

from kvstack.route.ray.config import RayOptions

__all__ = ["RayOptions"]
