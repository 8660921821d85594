"""A user's linen model cut for pipeline stages (fp8jax.models.StackParts): its parts compose to
the model at O0 and after fp8jax.convert (which then runs them in FP8), any slice of its
layers runs as a stage, a pipelined step of it equals one device's, and a builder's model
without the cut is refused at the run's start with the reason."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numerics import fresh_seed, rel_error

import fp8jax
from fp8jax import parallel
from fp8jax.config import config_from_dict
from fp8jax.models import StackParts
from fp8jax.train.step import PipelineLoop, pipeline_microbatches

from builder_models import tiny_lm, tiny_stack_lm

K, MB, SEQ, DEPTH = 4, 8, 8, 4  # microbatches, sequences per microbatch, tokens, layers


def _seed() -> int:
  return fresh_seed("stack parts")


def _model(level: str, tokens):
  model = tiny_stack_lm(depth=DEPTH)
  return model if level == "O0" else fp8jax.convert(model, level, tokens)[0]


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_parts_compose_to_the_model_and_any_slice_is_a_stage(level):
  seed = _seed()
  tokens = jax.random.randint(jax.random.key(seed), (2, SEQ), 0, 256)
  model = _model(level, tokens)
  variables = model.init(jax.random.key(seed + 1), tokens)
  parts = model.parts()
  stacked, shared = parts.split(variables)
  assert jax.tree.leaves(stacked) and all(x.shape[0] == DEPTH for x in jax.tree.leaves(stacked))
  assert jax.tree.structure(parts.merge(stacked, shared)) == jax.tree.structure(variables)
  x = parts.embed(shared, tokens)
  whole = parts.layers(stacked, x)
  np.testing.assert_allclose(parts.logits(shared, whole), model.apply(variables, tokens),
                             rtol=1e-6, atol=1e-6)
  first = jax.tree.map(lambda a: a[:1], stacked)
  rest = jax.tree.map(lambda a: a[1:], stacked)
  np.testing.assert_allclose(parts.layers(rest, parts.layers(first, x)), whole, rtol=1e-6,
                             atol=1e-6)


def test_converted_parts_run_in_fp8():
  """After convert, the parts' GEMMs are FP8: against the f64 reference of the same weights
  their logits err well above BF16's and within FP8's bound. (Over 151 seeds: FP8 0.075 to
  0.109, median 0.090; BF16 at most 0.010.)"""
  seed = _seed()
  tokens = jax.random.randint(jax.random.key(seed), (4, SEQ), 0, 256)
  plain, fp8 = _model("O0", tokens), _model("O1", tokens)
  variables = fp8.init(jax.random.key(seed + 1), tokens)
  params = {"params": variables["params"]}
  with jax.enable_x64():
    ref = plain.apply(jax.tree.map(lambda a: np.asarray(a, np.float64), params), tokens)
  parts = fp8.parts()
  stacked, shared = parts.split(variables)
  got = parts.logits(shared, parts.layers(stacked, parts.embed(shared, tokens)))
  f32 = plain.apply(params, tokens)
  bf16 = plain.apply(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), tokens)
  assert rel_error(f32, ref) < 1e-5
  assert 3 * rel_error(bf16, ref) < rel_error(got, ref) < 0.2, (rel_error(got, ref),
                                                                rel_error(bf16, ref))


def test_stack_parts_refuses_a_module_without_the_cut():
  with pytest.raises(ValueError, match=r"TinyLM has no method embed\(\), method blocks\(\)"):
    StackParts(tiny_lm())
  with pytest.raises(ValueError, match="depth=0|not a layer count"):
    StackParts(tiny_stack_lm(), layer_field="vocab_size")


def _loss(model, variables, batch):
  logits = model.apply(variables, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@pytest.mark.parametrize("level, schedule, tol", [("O0", "gpipe", 1e-5), ("O1", "1f1b", 0.03)])
def test_pipelined_step_of_a_user_model_matches_one_device(level, schedule, tol):
  """Pipeline 2 x data 4: loss and parameter gradients equal one device's mean over the K
  microbatches (f32 summation order at O0; FP8 rounding flips at O1, as in
  test_pipeline.py)."""
  seed = _seed()
  batch = np.asarray(jax.random.randint(jax.random.key(seed), (K * MB, SEQ + 1), 0, 256),
                     np.int32)
  model = _model(level, jnp.zeros((MB, SEQ), jnp.int32))
  variables = model.init(jax.random.key(seed + 1), jnp.zeros((MB, SEQ), jnp.int32))
  parts = batch.reshape(K, MB, SEQ + 1)
  losses, grads = zip(*[jax.value_and_grad(lambda v: _loss(model, v, p))(variables)
                        for p in parts])
  ref_loss = np.mean(losses)
  ref = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[g["params"] for g in grads])
  mesh = parallel.make_mesh(data=4, pipe=2)
  loop = PipelineLoop(mesh, model.parts(), schedule)
  placed = jax.device_put(variables, parallel.zero.replicated(variables, mesh))
  loss, got = jax.jit(lambda v, b: pipeline_microbatches(loop, v, b, K))(placed, batch)
  assert abs(float(loss) - ref_loss) < 1e-5 * ref_loss
  for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got["params"])[0],
                          jax.tree.leaves(ref)):
    assert np.linalg.norm(r) > 0, path
    assert rel_error(g, r) < tol, (jax.tree_util.keystr(path), rel_error(g, r))


def test_a_builder_without_the_cut_is_refused_at_start(tmp_path):
  from fp8jax.train.loop import Trainer
  config = config_from_dict({
      "model": {"builder": "builder_models:tiny_lm"},
      "data": {"seq_len": 16, "max_bytes": 100_000},
      "train": {"steps": 1, "batch_size": 16, "microbatches": 2, "eval_every": 0},
      "parallel": {"pipeline_parallel_size": 2}, "runtime": {"run_dir": str(tmp_path)}})
  with pytest.raises(ValueError, match=r"TinyLM has no parts\(\).*StackParts"):
    Trainer(config, progress=False).run()
