"""Tokenizers (GGUF metadata, SentencePiece, ``tokenizer.json``), chat templates and streaming
detokenization.
"""
