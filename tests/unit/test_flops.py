"""GEMM FLOPs counted from the jaxpr (fp8jax.models.flops): exact on hand-counted programs,
scan bodies times their length, and the GPT family's own formula (plus its one-hot embedding
GEMM) whether layers are scanned or unrolled."""
import jax
import jax.numpy as jnp
import pytest

from fp8jax.models.flops import gemm_flops, training_flops_per_token
from fp8jax.models.gpt import GPT, ModelConfig, flops_per_token, init_model


def test_counts_batched_dots_scans_and_the_larger_cond_branch():
  x, w, ws = jnp.ones((3, 4, 5)), jnp.ones((5, 6)), jnp.ones((7, 6, 6))
  assert gemm_flops(lambda a, b: a @ b, x, w) == (2 * 3 * 4 * 5 * 6, 0)
  bmm = lambda a, b: jnp.einsum("bij,bjk->bik", a, b)
  assert gemm_flops(bmm, x, jnp.ones((3, 5, 2))).flops == 2 * 3 * 4 * 5 * 2

  def scanned(a):
    return jax.lax.scan(lambda c, wi: (c @ wi, None), a @ w, ws)[0]
  assert gemm_flops(scanned, x).flops == 2 * 12 * 5 * 6 + 7 * 2 * 12 * 6 * 6

  def branch(a, p):
    return jax.lax.cond(p, lambda: (a @ w) @ ws[0], lambda: a @ w)
  assert gemm_flops(branch, x, True).flops == 2 * 12 * 5 * 6 + 2 * 12 * 6 * 6

  def looped(a):
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ ws[0], c[1] + 1),
                              (a @ w, 0))[0]
  assert gemm_flops(looped, x) == (2 * 12 * 5 * 6 + 2 * 12 * 6 * 6, 1)  # counted once


@pytest.mark.parametrize("scan", [True, False])
def test_gpt_training_flops_match_its_formula(scan):
  cfg = ModelConfig(d_model=64, n_layers=3, n_heads=2, d_ff=128, max_seq_len=32,
                    scan_layers=scan, remat=True)
  variables = jax.eval_shape(lambda: init_model(cfg, None, jax.random.key(0), 2, 32))
  got = training_flops_per_token(GPT(cfg, None).apply, variables, 2, 32)
  one_hot_embedding = 6 * cfg.vocab_size * cfg.d_model  # the family's embedding is a GEMM
  assert got == flops_per_token(cfg, 32) + one_hot_embedding
