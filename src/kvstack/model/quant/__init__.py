"""Weight-only quantized linear layers (``--quantization {none,int8,int4,gguf}``).

``packed.py`` (the packed layout, its reference dequantization), ``gguf_blocks.py`` (GGUF
blocks -> packed, without expanding), ``quantize.py`` (int8 / int4 at load), ``linear.py``
(``QuantLinear``: the C++ kernel at decode, dequantize + oneDNN at prefill) and
``schemes.py`` (the ``QUANTIZATIONS`` registry and the builder of a model's linears).
"""
