"""Shoal: a batched serving engine for Fish Speech DualAR text-to-speech models."""

__version__ = "0.1.0"
