"""Model naming as vLLM: a Hugging Face id found in the local hub cache (offline, as
``HF_HUB_OFFLINE=1``), and the served name defaulting to the string given."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstack.core.errors import ModelLoadError
from kvstack.model.loader.hf_cache import hub_cache_dir
from kvstack.model.loader.registry import resolve_model_path
from kvstack.serve.api.served_names import default_served_names
from kvstack.testing.tiny_models import (
    random_llama_weights,
    tiny_llama_config,
    write_gguf,
    write_hf_folder,
)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    repo = cache / "models--Org--Tiny-Model"
    cfg = tiny_llama_config()
    write_hf_folder(repo / "snapshots" / "abc123", cfg, random_llama_weights(cfg))
    (repo / "snapshots" / "old999").mkdir()  # an empty older snapshot: not a model
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    return cache


def test_cache_dir_follows_huggingface_hubs_order(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", "/x/hf")
    assert hub_cache_dir() == Path("/x/hf/hub")
    monkeypatch.setenv("HF_HUB_CACHE", "/y")
    assert hub_cache_dir() == Path("/y")


def test_a_cached_hf_id_resolves_and_is_served_under_its_name(hub: Path) -> None:
    snap = hub / "models--Org--Tiny-Model" / "snapshots" / "abc123"
    assert resolve_model_path("Org/Tiny-Model") == snap
    assert default_served_names("Org/Tiny-Model") == ("Org/Tiny-Model", "Tiny-Model")
    with pytest.raises(ModelLoadError, match="local hub cache"):
        resolve_model_path("Org/Missing")
    with pytest.raises(ModelLoadError):
        resolve_model_path("../etc/passwd")


def test_a_path_is_served_as_given_with_its_stem_as_alias(tmp_path: Path) -> None:
    cfg = tiny_llama_config()
    f = write_gguf(tmp_path / "tiny.Q8.gguf", cfg, random_llama_weights(cfg))
    assert default_served_names(str(f)) == (str(f), "tiny.Q8")
