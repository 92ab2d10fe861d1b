"""Offline checkpoint quantization (FP8 block-scaled, MXFP8) and the FP8 layers that load it."""
