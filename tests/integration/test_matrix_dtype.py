"""O2's master weights decoded straight to the compute dtype for the matrices
(``make_train_step(matrix_dtype=...)``): bit-identical training, less memory."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.models import GPT, ModelConfig
from fp8jax.optim import master_params
from fp8jax.train.optimizer import lr_schedule, make_fused_update, make_optimizer
from fp8jax.train.state import init_state
from fp8jax.train.step import make_train_step

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=16, remat=True)
B, T = 4, 16
HYPER = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0)


def _setup(level=fp8jax.O2):
  model = GPT(CFG, level.recipe)
  schedule = lr_schedule(1e-3, 1, 10, 0.1)
  tx = make_optimizer(schedule, level=level, **HYPER)
  return model, tx, make_fused_update(schedule, **HYPER), init_state(model, tx, level, B, T, 0)


def _run(step, state, key, microbatches, n=3):
  step = jax.jit(step)
  for i in range(n):
    batch = jax.random.randint(jax.random.fold_in(key, i), (B * microbatches, T + 1), 0, 256)
    state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  return jax.device_get(state)


def test_master_params_decode_matrices_to_matrix_dtype(key):
  _, _, _, state = _setup()
  wide = master_params(state.params)
  narrow = master_params(state.params, matrix_dtype=jnp.bfloat16)
  names = []
  for (path, w), n in zip(jax.tree_util.tree_leaves_with_path(wide), jax.tree.leaves(narrow),
                          strict=True):
    name = jax.tree_util.keystr(path)
    names.append((name.split("'")[-2], str(n.dtype), w.ndim))
    np.testing.assert_array_equal(np.asarray(n), np.asarray(w.astype(n.dtype)))
  # GEMM weights narrow; norm gains stay f32, also stacked over layers (rank 2).
  assert ("kernel", "bfloat16", 3) in names and ("embedding", "bfloat16", 2) in names
  assert ("scale", "float32", 2) in names and ("scale", "float32", 1) in names
  assert all(d == ("bfloat16" if k in ("kernel", "embedding") else "float32")
             for k, d, _ in names)


# Microbatch accumulation left to test_trainer_bf16_matrices_are_bit_identical (O3, 2
# microbatches, ZeRO-2, optax chain) for time; the fused update's narrow-gradient path
# is (1, True).
@pytest.mark.parametrize("microbatches, fused", [(1, False), (1, True)])
def test_bf16_matrices_train_bit_identically(key, microbatches, fused):
  """Three O2 steps (optax chain or fused update) with the matrices decoded to BF16 or to
  f32: every state array is bit-identical (the GPT casts its matrices to BF16 before use),
  and the weights moved."""
  model, tx, fused_update, state = _setup()
  kw = dict(fused_update=fused_update if fused else None)
  wide = _run(make_train_step(model.apply, tx, microbatches, **kw), state, key, microbatches)
  narrow = _run(make_train_step(model.apply, tx, microbatches, matrix_dtype=jnp.bfloat16, **kw),
                state, key, microbatches)
  for a, b in zip(jax.tree.leaves(wide), jax.tree.leaves(narrow), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  before = jax.tree.leaves(state.model_params())
  after = jax.tree.leaves(narrow.model_params())
  assert sum(not np.array_equal(a, b) for a, b in zip(before, after)) == len(before)


def test_plain_params_are_left_alone(key):
  """O1 (f32 params, no master weights): matrix_dtype changes nothing."""
  model, tx, _, state = _setup(fp8jax.O1)
  # Plain params are what the step differentiates, as they are (never narrowed).
  for a, b in zip(jax.tree.leaves(state.variables(jnp.bfloat16)),
                  jax.tree.leaves(state.variables()), strict=True):
    assert a is b
  assert all(p.dtype == jnp.float32
             for p in jax.tree.leaves(state.variables(jnp.bfloat16)["params"]))
  a = _run(make_train_step(model.apply, tx, 2), state, key, 2, n=2)
  b = _run(make_train_step(model.apply, tx, 2, matrix_dtype=jnp.bfloat16), state, key, 2, n=2)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _temp_bytes(step, state, microbatches):
  batch = jax.ShapeDtypeStruct((B * microbatches, T + 1), jnp.int32)
  return jax.jit(step).lower(state, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.xla_cpu_scheduler
@pytest.mark.parametrize("microbatches, fused", [(1, True), (2, False)])
def test_bf16_matrices_need_less_memory(microbatches, fused):
  """XLA's temporary buffers of the compiled O2 step (on this machine's backend) shrink by
  at least 2 bytes per GEMM weight (the decoded copy: 4 -> 2 bytes; the gradient of one
  microbatch: 4 -> 2). (One microbatch through the optax chain widens its gradient to f32
  for the chain, which XLA may keep: not asserted.)"""
  model = GPT(CFG.replace(d_model=256, d_ff=1024), fp8jax.O2.recipe)
  schedule = lr_schedule(1e-3, 1, 10, 0.1)
  tx = make_optimizer(schedule, level=fp8jax.O2, **HYPER)
  state = init_state(model, tx, fp8jax.O2, B, T, 0)
  from fp8jax.gemm_weights import gemm_weight_mask
  params = state.model_params()
  matrices = sum(w.size for w, m in zip(jax.tree.leaves(params),
                                        jax.tree.leaves(gemm_weight_mask(params))) if m)
  kw = dict(fused_update=make_fused_update(schedule, **HYPER) if fused else None)
  wide = _temp_bytes(make_train_step(model.apply, tx, microbatches, **kw), state, microbatches)
  narrow = _temp_bytes(make_train_step(model.apply, tx, microbatches,
                                       matrix_dtype=jnp.bfloat16, **kw), state, microbatches)
  print(f"temp bytes {wide} -> {narrow}: {(wide - narrow) / matrices:.2f} per GEMM weight")
  assert wide - narrow >= 2 * matrices, (wide, narrow, matrices)


def test_bad_matrix_dtype_is_refused():
  model, tx, _, _ = _setup()
  with pytest.raises(ValueError, match="matrix_dtype=.*int8.* is not a floating dtype"):
    make_train_step(model.apply, tx, 1, matrix_dtype=jnp.int8)


def test_fused_step_reads_narrow_plain_gradients(key):
  """The fused update takes BF16 gradients as the f32 gradients of the same values, and
  refuses integer ones by name."""
  from fp8jax.kernels import adam_update as K
  from fp8jax.optim import adamw as fp8_adamw, init_master
  from fp8jax.optim.fused import adamw_master_step
  k = jax.random.split(key, 3)
  params = {"kernel": jax.random.normal(k[0], (4, K.BLOCK)) * 0.05,  # through the kernel
            "scale": 1.0 + 0.1 * jax.random.normal(k[1], (96,))}     # through XLA
  g32 = jax.tree.map(lambda p: jax.random.normal(k[2], p.shape).astype(jnp.bfloat16)
                     .astype(jnp.float32), params)
  g16 = jax.tree.map(lambda g: g.astype(jnp.bfloat16), g32)
  master, opt_state = init_master(params), fp8_adamw(1e-3).init(params)
  # interpret=True: tensors of whole blocks go through the Pallas kernel (interpreted), the
  # others through XLA; both read the BF16 payloads.
  run = lambda g: jax.device_get(adamw_master_step(g, opt_state, master, learning_rate=1e-3,
                                                   interpret=True))
  wide, narrow = run(g32), run(g16)
  for a, b in zip(jax.tree.leaves(wide), jax.tree.leaves(narrow), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for name in params:  # both tensors moved
    assert np.mean(np.asarray(wide[0].params[name].data)
                   != np.asarray(master.params[name].data)) > 0.5
  with pytest.raises(ValueError, match="plain gradients must be one of .*got int8"):
    adamw_master_step(jax.tree.map(lambda g: g.astype(jnp.int8), g32), opt_state, master,
                      learning_rate=1e-3)


def test_decay_mask_spares_stacked_norm_gains():
  """Weight decay on kernels and embeddings only: layer norm gains stacked under scan are
  rank 2 and still not decayed."""
  from fp8jax.train.optimizer import decay_mask
  _, _, _, state = _setup()
  mask = decay_mask(state.model_params())
  flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
  assert flat["['layers']['norm_attn']['scale']"] is False
  assert flat["['norm_final']['scale']"] is False
  assert flat["['layers']['mlp']['fc_in']['kernel']"] is True
  assert flat["['embed']['embedding']"] is True
  assert sum(flat.values()) == 6 and len(flat) == 9


def test_cast_kernel_refuses_inputs_past_32_bit_offsets():
  """Inputs of 2**31 elements or more take the XLA path: Triton addresses the cast kernel's
  elements with 32-bit offsets."""
  from fp8jax.kernels import cast_transpose as ct
  with ct.interpret_anywhere():
    assert ct.kernel_reason((16384, 4096), jnp.bfloat16, jnp.float8_e4m3fn) is None
    assert "64-bit offsets" in ct.kernel_reason((32, 65536, 1024), jnp.bfloat16,
                                                jnp.float8_e4m3fn)


def test_fused_update_chunks_tensors_past_32_bit_offsets(key, monkeypatch):
  """A tensor larger than one kernel call may address (2**31 - 1 elements on a GPU; here the
  limit is lowered to 2 blocks) is updated in chunks, bit-identically to one call: the
  chunks continue the tensor's stochastic-rounding stream and amax blocks."""
  from fp8jax.kernels import adam_update as K
  from fp8jax.optim import fused, init_master
  from fp8jax.optim import adamw as fp8_adamw
  n = 5 * K.BLOCK
  assert fused._chunks(n) == [(0, n)]
  assert fused._chunks(2**32 - K.BLOCK)[-1][1] == 2**32 - K.BLOCK
  for a, b in fused._chunks(3 * 2**31 + 7 * K.BLOCK):
    assert a % K.BLOCK == 0 and b % K.BLOCK == 0 and 0 < b - a <= K.MAX_CALL_ELEMENTS
  assert not fused._use_kernel(2**32, interpret=True)
  k = jax.random.split(key, 3)
  params = {"kernel": jax.random.normal(k[0], (5, K.BLOCK)) * 0.05,
            "embedding": jax.random.normal(k[1], (2, K.BLOCK)) * 0.05}
  grads = jax.tree.map(lambda p: jax.random.normal(k[2], p.shape) * 1e-3, params)
  tx = fp8_adamw(1e-3)
  master, state = init_master(params), tx.init(params)

  def run():
    step = lambda g, s, m: fused.adamw_master_step(g, s, m, learning_rate=1e-3, interpret=True)
    m, s = master, state
    for _ in range(2):
      m, s = step(grads, s, m)
    return jax.device_get((m, s))

  whole = run()
  monkeypatch.setattr(K, "MAX_CALL_ELEMENTS", 2 * K.BLOCK + 5)
  assert fused._chunks(n) == [(0, K.BLOCK), (K.BLOCK, 3 * K.BLOCK), (3 * K.BLOCK, n)]
  chunked = run()
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = np.asarray(whole[0].params["kernel"].data) != np.asarray(master.params["kernel"].data)
  assert moved.mean() > 0.5
  with pytest.raises(ValueError, match="one call takes at most"):
    K.adam_master_update(*(jnp.zeros(n) for _ in range(4)), jnp.zeros(64), jnp.zeros(1, jnp.uint32),
                         jnp.zeros(8), (1.0, 1.0, 1.0), row=0, offset=0, b1=0.9, b2=0.999,
                         interpret=True)


# O3 is O2 with its master weights and optimizer state sharded: one case covers both
# (O2 unsharded: test_bf16_matrices_train_bit_identically).
@pytest.mark.parametrize("level, zero_stage", [("O3", 2)])
def test_trainer_bf16_matrices_are_bit_identical(tmp_path, monkeypatch, level, zero_stage):
  """Two Trainer steps of 2 microbatches with O2's GEMM weights decoded to BF16 (the
  Trainer's choice) and to f32: every state array bit-identical, under ZeRO-2 over the 8
  CPU devices."""
  from fp8jax.config import config_from_dict
  from fp8jax.train import loop
  from fp8jax.train import step as step_lib
  states, asked = {}, []
  wide = False

  def spy(*a, _f, matrix_dtype=None, **k):  # records the Trainer's choice, then overrides it
    asked.append((wide, str(matrix_dtype)))
    return _f(*a, matrix_dtype=None if wide else matrix_dtype, **k)

  monkeypatch.setattr(step_lib, "make_train_step",
                      functools.partial(spy, _f=step_lib.make_train_step))
  for wide in (False, True):
    cfg = config_from_dict({
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 16},
        "data": {"seq_len": 16, "max_bytes": 200_000},
        "train": {"steps": 2, "batch_size": 16, "microbatches": 2, "warmup_steps": 1,
                  "eval_every": 0, "opt_level": level},
        "parallel": {} if zero_stage is None else {"zero_stage": zero_stage},
        "runtime": {"run_dir": str(tmp_path / str(wide))}})
    trainer = loop.Trainer(cfg, progress=False)
    assert trainer.plan.stage == (zero_stage or 0)
    for s in range(2):
      trainer.state, m = trainer.step_fn(2)(trainer.state, trainer.next_batch(s))
    assert np.isfinite(float(m["loss"]))
    states[wide] = jax.device_get(trainer.state)
  assert asked and set(asked) == {(False, "bfloat16"), (True, "bfloat16")}, asked
  before = jax.tree.leaves(states[False].model_params())
  assert float(np.std(before[0])) > 0
  for a, b in zip(jax.tree.leaves(states[False]), jax.tree.leaves(states[True]), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
