"""A user's own Flax linen language model for ``model.builder`` tests: plain nn.Embed,
nn.Dense, nn.DenseGeneral and nn.Einsum layers, nothing of fp8jax."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.train import UserModel


class TinyLM(nn.Module):
  vocab: int = 256
  width: int = 32
  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
    for i in range(self.layers):
      h = nn.LayerNorm(name=f"norm_{i}")(x)
      h = nn.DenseGeneral((2, self.width // 2), name=f"up_{i}")(h)  # [B, T, 2, W/2]
      h = jax.nn.gelu(h).reshape(*h.shape[:-2], self.width)
      h = nn.Einsum((self.width, self.width), "btd,de->bte", name=f"mix_{i}")(h)
      x = x + nn.Dense(self.width, name=f"down_{i}")(h)
    return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="final_norm")(x)).astype(
        jnp.float32)


def tiny_lm(vocab: int = 256, width: int = 32, layers: int = 2):
  return TinyLM(vocab, width, layers)


def tiny_lm_with_flops(**kwargs):
  return UserModel(tiny_lm(**kwargs), flops_per_token=1234.0)
