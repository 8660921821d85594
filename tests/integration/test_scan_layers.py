"""model.scan_layers=False: the layers unrolled over layer slices of the scan's stacked
variables. Same parameters and math as the scan (f32: equal up to summation order), no loop
left in the compiled step, FP8-level accuracy at O1, and the collections it cannot write fall
back to the scan."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.config import load_config
from fp8jax.linen import HEALTH_COLLECTION
from fp8jax.models import GPT, ModelConfig, init_model
from fp8jax.models import gpt as gpt_module
from fp8jax.models.gpt import unstack_layers
from fp8jax.train import batch_loss

CFG = ModelConfig(d_model=64, n_layers=3, n_heads=2, d_ff=128, max_seq_len=32, remat=True,
                  remat_policy="save_gemm_outputs")
B, T = 2, 32


def _grad_fn(cfg: ModelConfig, recipe):
  model = GPT(cfg, recipe)
  return jax.jit(jax.value_and_grad(lambda v, b: batch_loss(model.apply, v, b)))


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def test_unstack_layers_gradient_is_the_stacked_layer_gradients(key):
  """The layer slices' gradients land in their own layer of the stacked gradient (a
  different nonlinear function per layer, so a swapped or summed layer fails); integer
  leaves (counters) get float0 gradients."""
  w = jax.random.normal(key, (4, 3, 5))
  variables = {"w": w, "count": jnp.arange(4, dtype=jnp.int32)}

  def loss(v, slices):
    return sum(jnp.sum(jnp.sin((i + 1) * s["w"])) * (s["count"] + 1)
               for i, s in enumerate(slices(v)))

  got = jax.grad(lambda v: loss(v, lambda v: unstack_layers(v, 4)), allow_int=True)(variables)
  want = jax.grad(lambda v: loss(v, lambda v: [jax.tree.map(lambda a: a[i], v)
                                              for i in range(4)]), allow_int=True)(variables)
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
  assert got["count"].dtype == jax.dtypes.float0 and got["count"].shape == (4,)
  assert [s["w"].shape for s in unstack_layers(variables, 4)] == [(3, 5)] * 4


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layers_are_the_scan_in_f32(key, remat):
  """In f32 (no bf16 rounding for XLA's different fusions to move) loss and every gradient
  agree up to f32 summation order (1e-7; a wrong layer slice would be O(1) off, a bf16
  rounding 1e-3); the compiled step has no while loop left."""
  cfg = CFG.replace(dtype="float32", remat=remat)
  k1, k2 = jax.random.split(key)
  variables = init_model(cfg, None, k1, B, T)
  batch = jax.random.randint(k2, (B, T + 1), 0, 256)
  out, loops = {}, {}
  for scan in (True, False):
    f = _grad_fn(cfg.replace(scan_layers=scan), None)
    loops[scan] = len(re.findall(r" while\(", f.lower(variables, batch).compile().as_text()))
    out[scan] = f(variables, batch)
  assert loops[True] > 0 and loops[False] == 0, loops
  assert float(np.abs(out[True][1]["params"]["layers"]["mlp"]["fc_in"]["kernel"]).max()) > 0
  assert jax.tree.structure(out[True]) == jax.tree.structure(out[False])
  assert float(out[False][0]) == pytest.approx(float(out[True][0]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(out[True][1]), jax.tree.leaves(out[False][1]), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a), a.shape


def test_unrolled_fp8_layers_are_as_accurate_as_the_scan(key):
  """O1 in bf16: XLA fuses the unrolled step differently (bf16 roundings move, E4M3/E5M2
  roundings flip), so the two FP8 runs are compared through the f32 model: the same FP8-level
  gradient error, clearly above BF16's. The FP8 state's update has the scan's shapes."""
  cfg = CFG.replace(remat_policy="save_gemm_io")
  recipe = fp8jax.O1.recipe
  k1, k2 = jax.random.split(key)
  variables = init_model(cfg, recipe, k1, B, T)
  batch = jax.random.randint(k2, (B, T + 1), 0, 256)
  params = {"params": variables["params"]}
  ref = _flat(_grad_fn(cfg.replace(dtype="float32", remat=False), None)(params, batch)[1])
  bf16 = _flat(_grad_fn(cfg, None)(params, batch)[1])
  rel = lambda g: float(np.linalg.norm(g - ref) / np.linalg.norm(ref))
  err, meta = {}, {}
  for scan in (True, False):
    loss, grads = _grad_fn(cfg.replace(scan_layers=scan), recipe)(variables, batch)
    assert np.isfinite(float(loss))
    err[scan] = rel(_flat(grads["params"]))
    meta[scan] = jax.tree.map(jnp.shape, grads["fp8_meta"])
  assert meta[True] == meta[False]
  assert 3 * rel(bf16) < err[True] < 0.3 and 3 * rel(bf16) < err[False] < 0.3, (err, rel(bf16))
  assert 0.75 < err[False] / err[True] < 1.33, err


def test_writing_collections_and_dropout(key, monkeypatch):
  """An apply that writes FP8 health runs the scan: the same logits and health values as the
  scanned model's, bit for bit, and both it and the unrolled apply within FP8 error of the
  f32 model (about 0.1 relative; f32 summation order flips a few E4M3 roundings, so the two
  FP8 outputs differ by up to ~0.4 of that error and are not compared to each other; the
  layer slices themselves are checked in f32 above). With dropout each layer draws its own mask
  (each unrolled layer gets a different dropout key; the output differs from the
  deterministic one and from a second key's)."""
  cfg = CFG.replace(dtype="float32", dropout_rate=0.5, scan_layers=False)
  recipe = fp8jax.O1.recipe
  k1, k2 = jax.random.split(key)
  variables = init_model(cfg, recipe, k1, B, T)
  tokens = jax.random.randint(k2, (B, T), 0, 256)
  model = GPT(cfg, recipe)
  probe = lambda m: m.apply(variables, tokens, mutable=[HEALTH_COLLECTION])
  probed, scanned = probe(model), probe(GPT(cfg.replace(scan_layers=True), recipe))
  assert probed[1][HEALTH_COLLECTION]["layers"]  # the scan's stacked health values
  for a, b in zip(jax.tree.leaves(probed), jax.tree.leaves(scanned), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  plain = np.asarray(model.apply(variables, tokens))
  assert 0 < np.max(np.abs(plain))
  ref = np.asarray(GPT(cfg, None).apply(variables, tokens))
  rel = lambda x: np.linalg.norm(np.asarray(x) - ref) / np.linalg.norm(ref)
  assert 1e-3 < rel(plain) < 0.2 and 1e-3 < rel(probed[0]) < 0.2, (rel(plain), rel(probed[0]))
  drop = lambda seed: model.apply(variables, tokens, deterministic=False,
                                  rngs={"dropout": jax.random.key(seed)})
  assert not np.allclose(drop(0), plain) and not np.allclose(drop(0), drop(1))
  assert np.all(np.isfinite(np.asarray(drop(0))))
  keys = []  # the dropout key each unrolled layer gets (no remat: concrete keys)
  apply = gpt_module.Block.apply

  def spy(self, *args, rngs=None, **kwargs):
    keys.append(tuple(np.asarray(jax.random.key_data(rngs["dropout"])).ravel()))
    return apply(self, *args, rngs=rngs, **kwargs)

  monkeypatch.setattr(gpt_module.Block, "apply", spy)
  GPT(cfg.replace(remat=False), recipe).apply(variables, tokens, deterministic=False,
                                               rngs={"dropout": jax.random.key(0)})
  assert len(keys) == cfg.n_layers and len(set(keys)) == cfg.n_layers, keys


def test_scan_layers_config():
  assert load_config("configs/tiny.yaml", ["model.scan_layers=false"]).model.scan_layers is False
  with pytest.raises(ValueError, match="scan_layers"):
    load_config("configs/tiny.yaml", ["model.scan_layers=sometimes"])
  with pytest.raises(ValueError, match=r"ModelConfig.scan_layers=1 is not allowed"):
    CFG.replace(scan_layers=1)


@pytest.mark.parametrize("family,scan", [("gpt", True), ("gpt", False), ("llama", True)])
def test_probe_taps_sit_beside_each_gemms_fp8_state(family, scan, key):
  """The probe's zero taps, built from the FP8 state, are the ones the model's apply creates
  (same paths, shapes and dtypes; stacked under the scan), with and without the head in FP8."""
  from fp8jax.linen import PERTURBATIONS
  from fp8jax.models import llama
  from fp8jax.train import health
  counts = []  # taps per model (the layers' are stacked, unrolled or not)
  for fp8_head in (False, True):
    if family == "gpt":
      cfg = CFG.replace(scan_layers=scan, fp8_head=fp8_head, tie_embeddings=False)
      model, init = GPT(cfg, fp8jax.Recipe()), init_model
    else:
      cfg = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              d_ff=48, max_seq_len=T, fp8_head=fp8_head)
      model, init = llama.Llama(cfg, fp8jax.Recipe()), llama.init_model
    variables = init(cfg, fp8jax.Recipe(), key, B, T)
    tokens = jnp.zeros((B, T), jnp.int32)
    made = jax.eval_shape(lambda v: model.apply(v, tokens, mutable=[PERTURBATIONS])[1],
                          variables)[PERTURBATIONS]
    built = health.taps(model, variables, tokens)
    assert jax.tree.structure(built) == jax.tree.structure(made), fp8_head
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(built)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(made)]
    counts.append(len(jax.tree.leaves(built)))
  assert counts[0] >= 2 * 4 and counts[1] == counts[0] + 2, counts  # (+ the FP8 head's pair)
