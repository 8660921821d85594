"""Reference models written against fp8jax's public API only."""
from fp8jax.models.gpt import (GPT, ModelConfig, flops_per_token, init_model,
                               matmul_param_count, next_token_loss, param_count)

__all__ = ["GPT", "ModelConfig", "flops_per_token", "init_model", "matmul_param_count",
           "next_token_loss", "param_count"]
