"""The fused O2 step (fp8jax.optim.fused) against the composed optax path it replaces."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax.optim as fo
from fp8jax.optim.fused import adamw_master_step
from fp8jax.train.optimizer import decay_mask

LR = optax.linear_schedule(1e-3, 1e-4, 10)


def _tree(key, scale, spread=False):
  k = jax.random.split(key, 3)
  t = {"w": jax.random.normal(k[0], (8, 1024)) * scale,   # kernel-sized (8192 = 4 blocks)
       "v": jax.random.normal(k[1], (96,)) * scale,        # falls back to the XLA path
       "e": jax.random.normal(k[2], (4, 512)) * scale}
  if spread:  # gradient magnitudes over 8 decades within one tensor
    t["w"] = t["w"] * 10.0 ** jax.random.uniform(k[0], (8, 1024), minval=-8, maxval=0)
  return t


def _composed(grads, state, master, tx):
  updates, state = tx.update(grads, state, fo.master_params(master))
  return fo.apply_master_updates(master, updates, finite=fo.all_finite(grads)), state


def _run(steps, fp8_grads, seed, interpret, poison=None):
  """(initial master, [(composed, fused) results of each step]). Both implementations start
  every step from the composed path's state, so a rare 1-ulp difference (which can move a
  per-tensor scale) does not cascade through later steps."""
  params = _tree(jax.random.key(seed), 0.05)
  tx = fo.adamw(LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask)
  fused = jax.jit(lambda g, s, m: adamw_master_step(
      g, s, m, learning_rate=LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask,
      interpret=interpret))
  composed = jax.jit(lambda g, s, m: _composed(g, s, m, tx))
  start = master = fo.init_master(params)
  state, pairs = tx.init(params), []
  for t in range(steps):
    g = _tree(jax.random.key(seed + 100 + t), 1e-3, spread=True)
    if poison is not None and t == poison:
      g["v"] = g["v"].at[3].set(jnp.nan)
    if fp8_grads:
      g = fo.quantize_updates(g)
    ref, out = composed(g, state, master), fused(g, state, master)
    pairs.append((ref, out))
    master, state = ref
  return start, pairs


def _ulp_diff(a, b):
  """(fraction of elements that differ, largest relative difference)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.mean(a != b), np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-30))


def _check_close(m_ref, s_ref, m_f, s_f):
  assert jax.tree.structure(s_ref) == jax.tree.structure(s_f)
  for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_f)):
    frac, rel = _ulp_diff(a, b)
    assert a.dtype == b.dtype and frac < 1e-3 and rel < 0.13, (frac, rel)  # <= 1 E4M3 ulp, rarely
  for a, b in zip(jax.tree.leaves(m_ref), jax.tree.leaves(m_f)):
    frac, rel = _ulp_diff(a, b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    if a.dtype == jnp.float32:  # tracked amaxes: f32 rounding order may differ
      assert rel < 1e-6, rel
    else:
      assert frac < 1e-3 and rel < 2.0 ** -9, (frac, rel)  # <= 1 FP16 ulp, rarely


@pytest.mark.parametrize("interpret", [True, False])
@pytest.mark.parametrize("fp8_grads", [True, False])
def test_fused_matches_composed(interpret, fp8_grads):
  start, pairs = _run(4, fp8_grads, seed=int(np.random.randint(1 << 20)), interpret=interpret)
  for (m_ref, s_ref), (m_f, s_f) in pairs:
    _check_close(m_ref, s_ref, m_f, s_f)
  m_f = pairs[-1][1][0]
  # The weights moved away from their start, and the kernel-sized tensor is stored FP16.
  assert np.mean(np.asarray(start.params["w"].data) != np.asarray(m_f.params["w"].data)) > 0.5
  assert m_f.params["w"].data.dtype == jnp.float16
  assert int(m_f.count) == 4


def test_fused_skips_nonfinite_step():
  _, pairs = _run(3, False, seed=7, interpret=True, poison=1)
  (m_before, s_before), _ = pairs[0]
  (m_ref, s_ref), (m_f, s_f) = pairs[1]  # the poisoned step: nothing may change
  assert int(m_f.count) == int(m_ref.count) == 1 and int(s_f[0].count) == 1
  for a, b in zip(jax.tree.leaves((m_before, s_before)), jax.tree.leaves((m_f, s_f))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fused_rejects_bad_input():
  params = _tree(jax.random.key(1), 0.05)
  tx = fo.adamw(1e-3)
  with pytest.raises(TypeError, match="adamw"):
    adamw_master_step(params, optax.adam(1e-3).init(params), fo.init_master(params),
                      learning_rate=1e-3)
  with pytest.raises(ValueError, match="float32"):
    adamw_master_step(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), tx.init(params),
                      fo.init_master(params), learning_rate=1e-3)
