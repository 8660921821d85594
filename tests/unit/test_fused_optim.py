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
  # Named as Flax names them: decay_mask decays the kernel and the embedding, not "v".
  t = {"kernel": jax.random.normal(k[0], (8, 1024)) * scale,   # 8192 = 4 blocks
       "v": jax.random.normal(k[1], (96,)) * scale,             # falls back to the XLA path
       "embedding": jax.random.normal(k[2], (4, 512)) * scale}
  if spread:  # gradient magnitudes over 8 decades within one tensor
    t["kernel"] = t["kernel"] * 10.0 ** jax.random.uniform(k[0], (8, 1024), minval=-8, maxval=0)
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


def _ulp_diff(a, b, floor_log2=None):
  """(elements that differ beyond the allowance, largest relative difference). The allowance,
  2 + n/500 elements, covers f32 math that differs by an ulp or two (a fused multiply-add, an
  approximate rsqrt) flipping a rounding of the 8/16-bit payload near a tie. With
  `floor_log2`, differences of elements below ``2**floor_log2`` of the tensor's largest are
  taken relative to that floor: a payload 8 decades below its tensor's largest sits among
  FP16 subnormals, where the two paths' f32 evaluation orders can land a few steps apart
  (seed 479292: 4.2677e-5 vs 4.3571e-5 in a tensor whose largest payload is 3274)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  excess = np.sum(a != b) - (2 + a.size // 500)
  floor = 1e-30 if floor_log2 is None else max(np.max(np.abs(a), initial=0) * 2.0 ** floor_log2,
                                               1e-30)
  return excess / max(a.size, 1), np.max(np.abs(a - b) / np.maximum(np.abs(a), floor))


def _check_close(m_ref, s_ref, m_f, s_f):
  assert jax.tree.structure(s_ref) == jax.tree.structure(s_f)
  for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_f)):
    frac, rel = _ulp_diff(a, b)
    assert a.dtype == b.dtype
    if a.dtype == jnp.float32:  # scales: the clip factor may be applied in another order
      assert rel < 1e-6, rel
    else:
      assert frac <= 0 and rel < 0.13, (frac, rel)  # <= 1 E4M3 ulp, rarely
  for a, b in zip(jax.tree.leaves(m_ref), jax.tree.leaves(m_f)):
    frac, rel = _ulp_diff(a, b, floor_log2=-16)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    if a.dtype == jnp.float32:  # tracked amaxes: f32 rounding order may differ
      assert rel < 1e-6, rel
    else:
      assert frac <= 0 and rel < 2.0 ** -9, (frac, rel)  # <= 1 FP16 ulp, rarely


@pytest.mark.parametrize("interpret", [True, False])
@pytest.mark.parametrize("fp8_grads", [True, False])
def test_fused_matches_composed(interpret, fp8_grads):
  seed = int(np.random.randint(1 << 20))
  print(f"seed {seed}")  # shown on failure
  start, pairs = _run(4, fp8_grads, seed=seed, interpret=interpret)
  for (m_ref, s_ref), (m_f, s_f) in pairs:
    _check_close(m_ref, s_ref, m_f, s_f)
  m_f = pairs[-1][1][0]
  # The weights moved away from their start, and the kernel-sized tensor is stored FP16.
  assert np.mean(np.asarray(start.params["kernel"].data) != np.asarray(m_f.params["kernel"].data)) > 0.5
  assert m_f.params["kernel"].data.dtype == jnp.float16
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
  with pytest.raises(ValueError, match="plain gradients must be one of .*float32.*got int32"):
    adamw_master_step(jax.tree.map(lambda x: x.astype(jnp.int32), params), tx.init(params),
                      fo.init_master(params), learning_rate=1e-3)


def test_fused_update_with_clipping_matches_chain():
  """The Trainer's fused update (clip factor folded into the scalars, finiteness from the
  norm) against optax.clip_by_global_norm + fp8jax.optim.adamw + apply_master_updates."""
  from fp8jax.train.optimizer import make_fused_update
  seed = int(np.random.randint(1 << 20))
  params = _tree(jax.random.key(seed), 0.05)
  clip = 0.01
  tx = optax.chain(optax.clip_by_global_norm(clip), fo.adamw(
      LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask))
  fused = jax.jit(make_fused_update(LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                    clip_norm=clip))

  @jax.jit
  def composed(g, s, m):
    updates, s = tx.update(g, s, fo.master_params(m))
    return fo.apply_master_updates(m, updates, finite=jnp.isfinite(optax.tree.norm(g))), s

  master, state = fo.init_master(params), tx.init(params)
  for t in range(3):
    g = _tree(jax.random.key(seed + 100 + t), 1e-3, spread=True)
    norm = optax.tree.norm(g)
    assert float(norm) > 2 * clip  # clipping is active
    m_ref, s_ref = composed(g, state, master)
    m_f, s_f = fused(master, state, g, jnp.isfinite(norm), norm)
    _check_close(m_ref, s_ref, m_f, s_f)
    master, state = m_ref, s_ref
  assert int(m_f.count) == 3


def test_fused_step_with_finite_given_reads_no_gradient_before_the_kernel():
  """With FP8 gradients and the finiteness flag supplied, no XLA op reduces over a gradient
  payload: the kernel is the only pass over the arrays."""
  params = {"w": jax.random.normal(jax.random.key(0), (8, 1024))}
  tx = fo.adamw(1e-3)
  g = fo.quantize_updates(jax.tree.map(lambda x: x * 1e-3, params))

  def step(finite):
    return jax.make_jaxpr(lambda g, s, m: adamw_master_step(
        g, s, m, learning_rate=1e-3, finite=finite, interpret=True))(
            g, tx.init(params), fo.init_master(params))

  def reductions(jaxpr):  # reductions over >= 8192 elements outside the Pallas call
    found = []
    for eqn in jaxpr.eqns:
      if eqn.primitive.name.startswith("reduce") and any(
          np.prod(v.aval.shape) >= 8192 for v in eqn.invars):
        found.append(eqn.primitive.name)
      for p in eqn.params.values():
        if hasattr(p, "jaxpr") and eqn.primitive.name != "pallas_call":
          found += reductions(p.jaxpr)
    return found
  assert reductions(step(None).jaxpr)  # the check reads the payloads
  assert not reductions(step(jnp.bool_(True)).jaxpr)


def test_first_moment_bound_holds_on_the_extremal_gradient_sequence():
  """u = m / sqrt(v) reaches Cauchy-Schwarz's bound (7.27 at b1=0.9, b2=0.999) when
  gradients grow by b2/b1 per step; the stored E4M3 u (scale capped by moments.u_cap) holds
  it without clipping: the payload stays below E4M3's largest value and decoded m / r stays
  within 20% of float64 Adam (a cap of 5.5 would clip it 24%; what remains is the drift of a
  3-bit recurrence fed the same gradient pattern every step)."""
  from fp8jax.optim import moments
  b1, b2, steps = 0.9, 0.999, 120
  signs = np.sign(np.random.default_rng().standard_normal(1024))
  tx = fo.scale_by_adam(b1, b2, eps=1e-30)
  state = tx.init({"w": jnp.zeros(1024)})
  update = jax.jit(tx.update)
  m = v = np.zeros(1024)
  for t in range(steps):
    g = signs * 1e-6 * (b2 / b1) ** t
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    _, state = update({"w": jnp.asarray(g, jnp.float32)}, state)
  exact = m / np.sqrt(v)
  assert np.max(np.abs(exact)) > 7.0  # the sequence is (nearly) extremal
  assert moments.u_cap(b1, b2, jnp.float8_e4m3fn, jnp.float16) > np.max(np.abs(exact))
  mu = state.mu["w"]
  assert np.max(np.abs(np.asarray(mu.data, np.float32))) < 448
  u = np.asarray(mu.data, np.float64) * float(mu.scale)
  np.testing.assert_allclose(u, exact, rtol=0.2)


def test_trainer_fused_optimizer_tracks_the_composed_path():
  from fp8jax.config import load_config
  from fp8jax.train.loop import Trainer
  losses = {}
  for fused in (False, True):
    cfg = load_config("configs/tiny.yaml", [
        "train.opt_level=O2", f"train.fused_optimizer={str(fused).lower()}", "train.steps=8",
        "train.warmup_steps=2", "train.eval_every=0", "train.batch_size=4", "model.n_layers=1",
        "model.d_model=64", "model.n_heads=2", "model.d_ff=256", "data.seq_len=64",
        "data.max_bytes=1048576", "train.learning_rate=3e-3"])
    trainer = Trainer(cfg, progress=False)
    out = []
    for s in range(8):
      trainer.state, m = trainer.step_fn(1)(trainer.state, trainer.next_batch(s))
      out.append(float(m["loss"]))
    losses[fused] = np.array(out)
  assert losses[True][-1] < losses[True][0] - 0.5  # it trains
  np.testing.assert_allclose(losses[True], losses[False], rtol=2e-3)
  for bad, what in ((["train.opt_level=O1"], "O2"), (["parallel.zero_stage=1"], "zero_stage")):
    with pytest.raises(ValueError, match=what):
      load_config("configs/tiny.yaml", ["train.opt_level=O2", "train.fused_optimizer=true"]
                  + bad)
  with pytest.raises(ValueError, match=r"train\.fused_optimizer='sometimes'.*'auto'"):
    load_config("configs/tiny.yaml", ["train.fused_optimizer=sometimes"])
  # auto (the default): on for O2 on one GPU, off for other levels and elsewhere; never refused
  for level in ("O1", "O2"):
    cfg = load_config("configs/tiny.yaml", [f"train.opt_level={level}", "parallel.zero_stage=1"])
    assert cfg.train.fused_optimizer == "auto"
  auto = Trainer(load_config("configs/tiny.yaml", ["train.opt_level=O2"]), progress=False)
  assert (auto.steps.fused_update is not None) is (jax.default_backend() == "gpu")


@pytest.mark.parametrize("fp8_grads", [True, False])
def test_fused_step_with_finite_false_changes_nothing(fp8_grads):
  """finite=False (say the loss overflowed while the gradients are finite) skips the step,
  which is what lets the Trainer's guard take the fused update's state without a select."""
  params = _tree(jax.random.key(3), 0.05)
  tx = fo.adamw(LR, weight_decay=0.1)
  master, state = fo.init_master(params), tx.init(params)
  g = _tree(jax.random.key(4), 1e-3)
  if fp8_grads:
    g = fo.quantize_updates(g)
  m2, s2 = jax.jit(lambda g, s, m: adamw_master_step(
      g, s, m, learning_rate=LR, weight_decay=0.1, finite=jnp.bool_(False),
      interpret=True))(g, state, master)
  for a, b in zip(jax.tree.leaves((master, state)), jax.tree.leaves((m2, s2))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _eqns_outside_kernels(jaxpr) -> int:
  """Equations of `jaxpr`, nested jits included, outside the adam kernels' calls."""
  n = 0
  for eqn in jaxpr.eqns:
    sub = [p for p in eqn.params.values() if hasattr(p, "jaxpr")]
    if eqn.primitive.name == "pallas_call" or eqn.params.get("name") == "adam_master_update":
      continue
    n += _eqns_outside_kernels(sub[0].jaxpr) if eqn.primitive.name in ("jit", "pjit") and sub \
        else 1
  return n


def test_fused_step_prepares_scalars_with_few_ops_per_tensor():
  """The per-tensor scalars, block maxima and new scales are built with whole-vector ops: each
  extra tensor adds a handful of equations (its kernel call, payload reshapes, its scale
  slices) around the kernels, not a few dozen."""
  def eqns(num):
    params = {f"t{i}": jax.random.normal(jax.random.key(i), (4, 2048)) for i in range(num)}
    g = fo.quantize_updates(jax.tree.map(lambda x: x * 1e-3, params))
    tx = fo.adamw(LR, weight_decay=0.1)
    return _eqns_outside_kernels(jax.make_jaxpr(lambda g, s, m: adamw_master_step(
        g, s, m, learning_rate=LR, weight_decay=0.1, finite=jnp.bool_(True), interpret=True))(
            g, tx.init(params), fo.init_master(params)).jaxpr)
  small, large = eqns(6), eqns(12)
  assert (large - small) / 6 <= 16, (small, large)
  assert small <= 260, small


def test_tensor_maxima_of_unequal_block_counts():
  from fp8jax.optim.fused import _tensor_maxima
  blocks = np.random.default_rng(0).standard_normal(34).astype(np.float32)
  for c in ([4, 8, 4, 16, 2], [4] * 5, [3, 1, 2]):  # gcd 2 + segments, reshape only, segments
    b = blocks[:sum(c)]
    want = [seg.max() for seg in np.split(b, np.cumsum(c)[:-1])]
    np.testing.assert_array_equal(np.asarray(_tensor_maxima(jnp.asarray(b), c)), want)


def test_fused_update_refuses_params_without_master_weights():
  from fp8jax.train.state import TrainState
  from fp8jax.train.step import apply_gradients
  params = {"w": jax.random.normal(jax.random.key(5), (4, 4))}
  state = TrainState(jnp.zeros((), jnp.int32), params, {}, optax.adam(1e-3).init(params))
  grads = {"params": jax.tree.map(jnp.ones_like, params)}
  with pytest.raises(ValueError, match="needs FP16 master weights.*got params of type dict"):
    apply_gradients(state, optax.adam(1e-3), grads, jnp.float32(1.0),
                    fused_update=lambda *a: a[:2])
