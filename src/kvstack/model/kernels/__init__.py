"""The C++ kernels (``csrc/``): building and loading them, and which kernel runs on this CPU."""
