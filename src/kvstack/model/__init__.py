"""The model: families (``arch/``), checkpoint loaders (``loader/``), tokenizers and chat
templates (``tokenizer/``), C++ kernels (``kernels/``), quantized weights (``quant/``),
sampling (``sampling/``), structured-output masks (``structured/``), and the runner that
turns a scheduled step into tensors, logits and tokens (``runner.py``).
"""
