"""Checkpoints to weights: GGUF and Hugging Face folders, model names, fingerprints, generation
configs.
"""
