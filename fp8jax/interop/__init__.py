"""Interoperability with other ecosystems' model formats: Hugging Face LLaMA checkpoints
(:mod:`fp8jax.interop.hf`)."""
from fp8jax.interop import hf

__all__ = ["hf"]
