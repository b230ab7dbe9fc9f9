"""This process's Ray Serve routers, for the ingress's ``GET /router/state``.

Ray ships a deployment's request-router class to the caller by value (cloudpickle), so
a class attribute would live on a copy; a module is always shipped by reference, so
the list lives here.
"""

from __future__ import annotations

from typing import Any

ROUTERS: list[Any] = []
