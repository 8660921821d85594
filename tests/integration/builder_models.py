"""A user's own Flax linen language model for ``model.builder`` tests: plain nn.Embed,
nn.Dense, nn.DenseGeneral and nn.Einsum layers (TinyStackLM also cuts itself for pipeline
stages with fp8jax.models.StackParts)."""
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from fp8jax.models import StackParts
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


class TinyNnxLM(nnx.Module):
  """The same kind of model in NNX: nnx.Embed, nnx.Linear, nnx.Einsum."""

  def __init__(self, vocab: int = 256, width: int = 32, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.up = nnx.Linear(width, 2 * width, rngs=rngs)
    self.mix = nnx.Einsum("btf,fd->btd", (2 * width, width), rngs=rngs)
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.mix(jax.nn.gelu(self.up(x)))
    return self.head(self.norm(x)).astype(jnp.float32)


def tiny_nnx_lm(vocab: int = 256, width: int = 32):
  return TinyNnxLM(vocab, width)


class _StackBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(2 * self.width, name="up")(nn.LayerNorm(name="norm")(x))
    return x + nn.Dense(self.width, name="down")(jax.nn.gelu(h)), None


class TinyStackLM(nn.Module):
  """A user's LM cut for pipeline stages (fp8jax.models.stack_parts's contract): embed /
  blocks / head methods, the blocks an nn.scan named "layers" of `depth` layers."""
  vocab: int = 256
  width: int = 32
  depth: int = 2

  def setup(self):
    self.tok = nn.Embed(self.vocab, self.width)
    self.layers = nn.scan(_StackBlock, variable_axes={True: 0}, split_rngs={"params": True},
                          length=self.depth)(self.width)
    self.final_norm = nn.LayerNorm()
    self.out = nn.Dense(self.vocab)

  def embed(self, tokens):
    return self.tok(tokens)

  def blocks(self, x):
    return self.layers(x, None)[0]

  def head(self, x):
    return self.out(self.final_norm(x)).astype(jnp.float32)

  def __call__(self, tokens):
    return self.head(self.blocks(self.embed(tokens)))

  def parts(self):
    return StackParts(self, layer_field="depth")


def tiny_stack_lm(vocab: int = 256, width: int = 32, depth: int = 2):
  return TinyStackLM(vocab, width, depth)
