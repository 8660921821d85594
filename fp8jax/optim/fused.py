"""The O2 optimizer step in one pass per tensor: ``fp8jax.optim.adamw`` + FP16 master weights.

:func:`adamw_master_step` computes what ::

  updates, state = fp8jax.optim.adamw(lr, b1, b2, eps, weight_decay=wd, mask=mask).update(
      grads, state, fp8jax.optim.master_params(master))
  master = fp8jax.optim.apply_master_updates(master, updates, finite=...)

computes (same state trees, same scales, same stochastic-rounding stream), but each tensor's
gradient, moments and master weight are read once and written once by a fused kernel
(:mod:`fp8jax.kernels.adam_update`) on GPUs; elsewhere, and for tensors whose size is not a
multiple of the kernel's block, the same per-element function runs through XLA. Per-tensor
scalars (scales, bias corrections, learning rate) come first from the old scales and the
gradients' scales (:mod:`fp8jax.optim.moments`' bounds), as in the composed path; the kernel
writes the moments and the master weight in place (donate them to avoid copies). Unsharded
(single-device or replicated) arrays only: a Pallas call does not partition under ``jax.jit``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp8jax.kernels import adam_update as K
from fp8jax.kernels.rounding import hash32
from fp8jax.optim import moments
from fp8jax.optim.master import MasterWeights, payload_max, write_scales
from fp8jax.optim.scaled import ScaledArray, amaxes, is_scaled
from fp8jax.optim.transforms import ScaleByAdamState

# Plain (unscaled) gradient dtypes the step accepts.
PLAIN_GRAD_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def _inv(s):
  return jnp.where(s > 0, 1.0 / s, 0.0)


def _use_kernel(n: int, interpret) -> bool:
  """Whether a tensor of `n` elements goes through the Pallas kernel (else XLA)."""
  return n % K.BLOCK == 0 and n < 2**32 and (interpret or jax.default_backend() == "gpu")


def _chunks(n: int) -> list[tuple[int, int]]:
  """(start, stop) of the kernel calls covering `n` elements: one call unless `n` exceeds
  ``K.MAX_CALL_ELEMENTS``, else equal-ish chunks, each a multiple of ``K.BLOCK``."""
  limit = K.MAX_CALL_ELEMENTS // K.BLOCK * K.BLOCK
  if n <= limit:
    return [(0, n)]
  blocks, parts = n // K.BLOCK, -(-n // limit)
  cuts = [K.BLOCK * (blocks * j // parts) for j in range(parts + 1)]
  return list(zip(cuts[:-1], cuts[1:]))


def _kernel_update(i, gd, mu, nu, w, table, seed, blocks, offset, b1, b2, interpret):
  """Tensor `i`'s kernel update, in chunks of at most ``K.MAX_CALL_ELEMENTS`` (see
  :func:`_chunks`; each chunk is copied out and the results joined: a tensor that large pays
  one extra pass). Returns (mu', nu', w' flat, blocks', [mu, nu, w scales])."""
  flat = [x.reshape(-1) for x in (gd, mu.data, nu.data, w.data)]
  scales = (mu.scale, nu.scale, w.scale)
  outs = []
  for a, b in _chunks(flat[0].shape[0]):
    m2, v2, w2, blocks, scales = K.adam_master_update(
        *(x[a:b] if (a, b) != (0, x.shape[0]) else x for x in flat), table, seed.reshape(1),
        blocks, scales, row=i, offset=offset + a // K.BLOCK, b1=b1, b2=b2, start=a,
        interpret=interpret, block=K.BLOCK, num_warps=K.NUM_WARPS)
    outs.append((m2, v2, w2))
  joined = [o[0] if len(outs) == 1 else jnp.concatenate(o) for o in zip(*outs)]
  return (*joined, blocks, [x.reshape(()) for x in scales])


def _stack_scales(scales) -> jax.Array:
  """f32[L]: L per-tensor scales (f32[] arrays or Python floats), one stack."""
  if all(isinstance(x, float) for x in scales):
    return jnp.asarray(np.array(scales, np.float32).reshape(-1))
  return jnp.stack([jnp.asarray(x, jnp.float32) for x in scales])


def _write_scales(amax: jax.Array, dtypes) -> jax.Array:
  """f32[L]: :func:`write_scales` of f32[L] amaxes for payload `dtypes` (one per tensor)."""
  kinds = sorted(set(dtypes), key=str)
  out = write_scales(amax, kinds[0]) if kinds else jnp.zeros((0,), jnp.float32)
  for d in kinds[1:]:
    out = jnp.where(np.array([x == d for x in dtypes], bool), write_scales(amax, d), out)
  return out


def _scalar_matrix(columns: dict, num: int) -> jax.Array:
  """f32[num, K.NUM_SCALARS]: row i = tensor i's kernel scalars; `columns` maps each ``K.S_*``
  index to an f32[num] vector or a scalar shared by all tensors."""
  cols = [jnp.broadcast_to(jnp.asarray(columns[k], jnp.float32), (num,))
          for k in range(K.NUM_SCALARS)]
  return jnp.stack(cols, axis=1)


def _tensor_maxima(blocks: jax.Array, counts) -> jax.Array:
  """f32[len(counts)]: the max of each tensor's entries of `blocks` (f32[sum(counts)], tensor
  j's ``counts[j] > 0`` entries consecutive, in order). Groups of gcd(counts) entries are
  reduced by a reshape; a segmented max over a constant id vector finishes unequal counts."""
  counts = [int(c) for c in counts]
  g = math.gcd(*counts) or 1
  part = blocks.reshape(-1, g).max(axis=1) if g > 1 else blocks
  if all(c == g for c in counts):
    return part
  ids = np.repeat(np.arange(len(counts), dtype=np.int32), [c // g for c in counts])
  return jax.ops.segment_max(part, ids, num_segments=len(counts), indices_are_sorted=True)


def _merge_amaxes(kernel_amax, fallback_amax, kernel) -> jax.Array:
  """f32[L] in tensor order from the kernel tensors' maxima (f32[#kernel] or None) and the
  other tensors' (a list of f32[]); `kernel`: L bools."""
  if not any(kernel):
    return jnp.stack(fallback_amax) if fallback_amax else jnp.zeros((0,), jnp.float32)
  if all(kernel):
    return kernel_amax
  kernel = np.array(kernel, bool)
  rank = np.cumsum(kernel) - 1, np.cumsum(~kernel) - 1 + int(kernel.sum())
  perm = np.where(kernel, rank[0], rank[1]).astype(np.int32)
  return jnp.concatenate([kernel_amax, jnp.stack(fallback_amax)])[perm]


def _unstack(v: jax.Array) -> list:
  """The entries of f32[n] as n f32[] arrays (one split)."""
  if v.shape[0] == 0:
    return []
  return [x.reshape(()) for x in jnp.split(v, v.shape[0])]


def _check_state(state) -> tuple:
  """(adam state, decay state, learning-rate state) of ``fp8jax.optim.adamw``'s `state`."""
  if not (isinstance(state, tuple) and len(state) == 3
          and isinstance(state[0], ScaleByAdamState)):
    raise TypeError("adamw_master_step: state must be fp8jax.optim.adamw's state "
                    "(ScaleByAdamState, decay state, learning-rate state), got "
                    f"{type(state).__name__}")
  return state


def _leaves(grads, adam_state: ScaleByAdamState, master: MasterWeights) -> tuple:
  """(treedef, gradients, master weights, first moments, second moments) as leaf lists in the
  gradients' tree order; ValueError for an unscaled master leaf or a plain gradient of a dtype
  outside :data:`PLAIN_GRAD_DTYPES`."""
  g_leaves, treedef = jax.tree.flatten(grads, is_leaf=is_scaled)
  w_leaves = treedef.flatten_up_to(master.params)
  mus, nus = treedef.flatten_up_to(adam_state.mu), treedef.flatten_up_to(adam_state.nu)
  for g, w in zip(g_leaves, w_leaves):
    if not is_scaled(w):
      raise ValueError("adamw_master_step: every master leaf must be a ScaledArray")
    if not is_scaled(g) and np.dtype(g.dtype) not in PLAIN_GRAD_DTYPES:
      raise ValueError("adamw_master_step: plain gradients must be one of "
                       f"{[str(d) for d in PLAIN_GRAD_DTYPES]}, got {g.dtype}")
  return treedef, g_leaves, w_leaves, mus, nus


def _decayed(mask, treedef, w_leaves) -> list[bool]:
  """Per tensor: whether weight decay applies (`mask` as ``optax.add_decayed_weights`` takes
  it: None for all, a tree of bools or a function of the params)."""
  if mask is None:
    return [True] * len(w_leaves)
  params_like = jax.tree.unflatten(treedef, [w.data for w in w_leaves])
  m = mask(params_like) if callable(mask) else mask
  return [bool(x) for x in treedef.flatten_up_to(m)]


def _finite(g_leaves, finite) -> tuple:
  """(f32[L] gradient amaxes or None, bool[] whether the step runs): `finite` alone when every
  gradient is scaled (no pass over them), else the amaxes' finiteness (and `finite`)."""
  if finite is not None and all(is_scaled(g) for g in g_leaves):
    return None, jnp.asarray(finite, jnp.bool_)
  amax_g = amaxes(g_leaves)
  ok = jnp.all(jnp.isfinite(amax_g))
  if finite is not None:
    ok = ok & jnp.asarray(finite, jnp.bool_)
  return amax_g, ok


def _moment_scales(g_leaves, amax_g, mus, nus, b1, b2, grad_scale, ok) -> tuple:
  """(g_scales, g_mult, mu_old, nu_old, mu_scale, nu_scale): the gradients' scales (f32[L]; 1
  where plain), the clipping factor (f32[]), the moments' old and new scales (f32[L]; the old
  ones where the step is skipped), from the gradients' bounds (:mod:`fp8jax.optim.moments`)."""
  mu_old = _stack_scales([mu.scale for mu in mus])
  nu_old = _stack_scales([nu.scale for nu in nus])
  mu_dtype = mus[0].data.dtype if mus else jnp.float8_e4m3fn
  nu_dtype = nus[0].data.dtype if nus else jnp.float16
  g_scales = _stack_scales([g.scale if is_scaled(g) else 1.0 for g in g_leaves])
  # Per leaf, then stacked (as the composed path: XLA folds constants differently otherwise).
  g_bound = moments.grad_bounds(g_leaves, amax_g)
  g_mult = jnp.float32(1.0) if grad_scale is None else jnp.asarray(grad_scale, jnp.float32)
  mu_scale, nu_scale = moments.next_scales(mu_old, nu_old, g_bound * g_mult, b1, b2, mu_dtype,
                                           nu_dtype)
  mu_scale, nu_scale = jnp.where(ok, mu_scale, mu_old), jnp.where(ok, nu_scale, nu_old)
  return g_scales, g_mult, mu_old, nu_old, mu_scale, nu_scale


def _step_size(count, learning_rate, lr_state, b1, b2) -> tuple:
  """(count', bc1, bc2, -lr, lr state'): Adam's step count after this step, its bias
  corrections 1 - b^count (f32[]), the negated learning rate and the schedule's next state."""
  count = optax.safe_int32_increment(count)
  bc1 = 1.0 - jnp.asarray(b1, jnp.float32) ** count.astype(jnp.float32)
  bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** count.astype(jnp.float32)
  if callable(learning_rate):
    step_size = -learning_rate(lr_state.count)
    new_lr_state = lr_state._replace(count=optax.safe_int32_increment(lr_state.count))
  else:
    step_size, new_lr_state = -learning_rate, lr_state
  return count, bc1, bc2, step_size, new_lr_state


def _master_scales(w_leaves, w_old_amax) -> tuple:
  """(old scales, new scales, payload limits), f32[L] each, of the master weights: the new
  scale writes the old amax (:func:`write_scales`); a weight whose new amax exceeds its limit
  is clipped."""
  w_dtypes = [np.dtype(w.data.dtype) for w in w_leaves]
  w_old_scale = _stack_scales([w.scale for w in w_leaves])
  w_scale = _write_scales(w_old_amax, w_dtypes)
  limits = w_scale * np.array([payload_max(d) for d in w_dtypes], np.float32)
  return w_old_scale, w_scale, limits


def _update_tensors(g_leaves, mus, nus, w_leaves, scalars, seed, b1, b2, interpret) -> tuple:
  """Every tensor's update with its row of `scalars` (f32[L, K.NUM_SCALARS]): the kernel's
  where :func:`_use_kernel`, else the same function through XLA. Returns ([(mu', nu', w')
  payloads], f32[L] new master amaxes, {i: [mu, nu, w scales]} the kernel wrote, L bools:
  through the kernel)."""
  sizes = [math.prod(w.data.shape) for w in w_leaves]
  kernel = [_use_kernel(n, interpret) for n in sizes]
  offsets = np.cumsum([0] + [n // K.BLOCK if k else 0 for n, k in zip(sizes, kernel)])
  if any(kernel):
    table = K.scalar_table(scalars)
    blocks = jnp.zeros((int(offsets[-1]),), jnp.float32)
  new_data, fallback_amax, kernel_scales = [], [], {}
  for i, (g, mu, nu, w) in enumerate(zip(g_leaves, mus, nus, w_leaves)):
    gd = g.data if is_scaled(g) else g
    shape = gd.shape
    if kernel[i]:
      m2, v2, w2, blocks, kernel_scales[i] = _kernel_update(  # scales written by the kernel
          i, gd, mu, nu, w, table, seed, blocks, int(offsets[i]), b1, b2, interpret)
    else:
      index = jnp.arange(sizes[i], dtype=jnp.uint32).reshape(shape)
      leaf_seed = seed + jnp.uint32(i)  # apply_master_updates' stream
      m2, v2, w2, mag = K.update_reference(gd, mu.data, nu.data, w.data, scalars[i], leaf_seed,
                                           index, b1, b2)
      fallback_amax.append(jnp.max(mag, initial=0.0))
    new_data.append((m2.reshape(shape), v2.reshape(shape), w2.reshape(shape)))
  kernel_amax = _tensor_maxima(blocks, np.diff(offsets)[np.array(kernel, bool)]) \
      if any(kernel) else None
  return new_data, _merge_amaxes(kernel_amax, fallback_amax, kernel), kernel_scales, kernel


def _new_scales(kernel, kernel_scales, mu_scale, nu_scale, w_scale, w_old_scale, ok) -> list:
  """Per tensor [mu, nu, w] new scales (f32[] each): the kernel's where it ran, else rows of
  the stacked f32[L] vectors (one split; the master's new scale where the step runs (`ok`),
  else its old one)."""
  new_scales = [kernel_scales.get(i) for i in range(len(kernel))]
  if not all(kernel):
    rest = np.flatnonzero(~np.array(kernel, bool))
    cols = jnp.stack([mu_scale, nu_scale, jnp.where(ok, w_scale, w_old_scale)], axis=1)
    flat = _unstack(cols[rest].reshape(-1))
    for j, i in enumerate(rest):
      new_scales[i] = flat[3 * j:3 * j + 3]
  return new_scales


def adamw_master_step(grads, state, master: MasterWeights, *, learning_rate, b1: float = 0.9,
                      b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
                      mask=None, finite=None, grad_scale=None, interpret: bool = False):
  """``(new_master, new_state)`` of one AdamW step on FP16 master weights (see module doc).

  Args:
    grads: tree like the params: f32 / bf16 / f16 arrays (read once, widened to f32 in the
      kernel) or ScaledArray (FP8 payload + scale).
    state: the state of ``fp8jax.optim.adamw(learning_rate, b1, b2, eps, ...)`` (a tuple
      ``(ScaleByAdamState, decay state, learning-rate state)``).
    master: FP16 master weights (:func:`fp8jax.optim.init_master`), every leaf scaled.
    learning_rate, b1, b2, eps, weight_decay, mask: as given to ``fp8jax.optim.adamw``.
    finite: bool[]; False skips the step (nothing changes), e.g. the clipping norm's or the
      loss's finiteness. When every gradient is scaled it replaces the optimizer's own check,
      so the step reads nothing before the kernels; otherwise both must pass. Default: the
      gradients' amaxes are read to check (what the optimizer does).
    grad_scale: optional f32[] the gradients are multiplied by first (global-norm clipping's
      factor), folded into the per-tensor scalars: no pass over the gradients.
    interpret: run the kernel through Pallas' interpreter (tests on CPU).
  """
  adam_state, decay_state, lr_state = _check_state(state)
  treedef, g_leaves, w_leaves, mus, nus = _leaves(grads, adam_state, master)
  decayed = _decayed(mask, treedef, w_leaves)
  amax_g, ok = _finite(g_leaves, finite)
  g_scales, g_mult, mu_old, nu_old, mu_scale, nu_scale = _moment_scales(
      g_leaves, amax_g, mus, nus, b1, b2, grad_scale, ok)
  count, bc1, bc2, step_size, new_lr_state = _step_size(adam_state.count, learning_rate,
                                                        lr_state, b1, b2)
  w_old_amax = master.amax if master.amax is not None else amaxes(w_leaves)
  seed = hash32(master.count.astype(jnp.uint32))
  w_old_scale, w_scale, limits = _master_scales(w_leaves, w_old_amax)
  scalars = _scalar_matrix({
      K.S_G: g_scales * g_mult, K.S_MU_OLD: mu_old, K.S_NU_OLD: nu_old,
      K.S_INV_MU: _inv(mu_scale), K.S_NU_NEW: nu_scale, K.S_INV_NU: _inv(nu_scale),
      K.S_BC1: bc1, K.S_RFAC: nu_scale / jnp.sqrt(bc2), K.S_EPS: eps,
      K.S_WD: np.array([weight_decay if d else 0.0 for d in decayed], np.float32),
      K.S_STEP: step_size, K.S_OK: ok.astype(jnp.float32), K.S_W_OLD: w_old_scale,
      K.S_W_NEW: w_scale, K.S_INV_W: _inv(w_scale), K.S_MU_NEW: mu_scale}, len(w_leaves))
  new_data, new_amax, kernel_scales, kernel = _update_tensors(
      g_leaves, mus, nus, w_leaves, scalars, seed, b1, b2, interpret)
  new_scales = _new_scales(kernel, kernel_scales, mu_scale, nu_scale, w_scale, w_old_scale, ok)
  unflat = lambda k: jax.tree.unflatten(treedef, [ScaledArray(d[k], sc[k])
                                                  for d, sc in zip(new_data, new_scales)])
  n = len(w_leaves)
  amax_w = new_amax if n else w_old_amax
  clipped = ok & jnp.any(amax_w > limits) if n else jnp.bool_(False)
  previous = jnp.zeros((), jnp.int32) if master.clipped is None else master.clipped
  new_adam = ScaleByAdamState(jnp.where(ok, count, adam_state.count), unflat(0), unflat(1))
  new_state = (new_adam, decay_state,
               jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_lr_state, lr_state))
  new_master = MasterWeights(unflat(2), master.count + ok.astype(jnp.int32),
                             jnp.where(ok, amax_w, w_old_amax),
                             previous + clipped.astype(jnp.int32))
  return new_master, new_state
