"""A Hugging Face id (``HuggingFaceTB/SmolLM2-135M-Instruct``) found in the local hub cache.

vLLM resolves ``vllm serve ORG/NAME`` through ``huggingface_hub``, which with
``HF_HUB_OFFLINE=1`` reads only the cache. kvstack never downloads, so it does that
offline resolution only: the cache folder is ``$HF_HUB_CACHE``, else
``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub`` (huggingface_hub's order); the model's snapshot is
``models--ORG--NAME/snapshots/<commit>/`` where ``refs/<revision>`` (default ``main``)
names the commit, else the newest snapshot that holds a model. Nothing is fetched.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_cache_dir() -> Path:
    """The hub cache folder as huggingface_hub finds it (see the module docstring)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _holds_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() or any(folder.glob("*.gguf"))


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision``, or None if the cache
    has no copy of it (or ``repo_id`` is not an ``ORG/NAME`` id)."""
    if not REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        return None
    org, name = repo_id.split("/")
    repo = hub_cache_dir() / f"models--{org}--{name}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / revision
    if ref.is_file():
        pinned = snapshots / ref.read_text(encoding="utf-8").strip()
        if _holds_model(pinned):
            return pinned
    found = [s for s in snapshots.iterdir() if s.is_dir() and _holds_model(s)]
    return max(found, key=lambda s: s.stat().st_mtime) if found else None
