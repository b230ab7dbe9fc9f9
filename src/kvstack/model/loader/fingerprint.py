"""``model_fingerprint``: a short digest of a model's identity *and weights*.

Offload tiers (``kv/tiers/``) key every stored block by it, so two fine-tunes of one
base (same name, same shapes) never read each other's KV. Hashing a slice of the
embedding and the final norm costs microseconds and tells weights apart. Quantized
linears (``--quantization`` other than none) compute other K/V from the same file: the
scheme is hashed too (``none`` adds nothing, so dense fingerprints are unchanged).
"""

from __future__ import annotations

from hashlib import blake2b

from kvstack.model.arch.decoder import LlamaModel


def model_fingerprint(model: LlamaModel) -> str:
    """16 hex digits over the config (name included), the weight quantization,
    ``embed[:64]`` and the final norm."""
    h = blake2b(digest_size=8, person=b"kvstack-model")
    h.update(model.config.name.encode())
    h.update(repr(model.config).encode())
    if model.quantization != "none":
        h.update(f"quantization={model.quantization}".encode())
    for t in (model.embed[:64], model.norm):
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()
