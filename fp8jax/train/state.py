"""The train state: a plain pytree of everything a step reads and writes."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.linen import FP8_COLLECTION
from fp8jax.optim import MasterWeights, init_master, master_params
from fp8jax.parallel.grad_comm import init_grad_comm_scaling


class TrainState(NamedTuple):
  """Attributes:
    step: int32[] optimizer steps taken.
    params: model parameters (the optimizer's only input besides gradients); at O2/O3 an
      ``fp8jax.optim.MasterWeights`` (FP16 + per-tensor scale) that the model reads decoded.
    fp8: the model's FP8 collection ({} when the model has no FP8 GEMMs); never seen by
      the optimizer, replaced by its updated value every step.
    opt_state: optimizer state.
    comm: FP8 gradient-communication scaling state: a
      ``fp8jax.parallel.collectives.CommScaling`` of f32[L] / i32[L] (L = number of parameter
      leaves) with ``parallel.grad_comm_scaling=auto``, else ``()``. Replicated.
  """

  step: jax.Array
  params: Any
  fp8: Any
  opt_state: Any
  comm: Any = ()

  def model_params(self, matrix_dtype=None):
    """The parameters the model computes from: master weights decoded to f32, their GEMM
    weights (kernels, embeddings) to `matrix_dtype` when given; plain params as they are."""
    if isinstance(self.params, MasterWeights):
      return master_params(self.params, matrix_dtype=matrix_dtype)
    return self.params

  def variables(self, matrix_dtype=None) -> dict:
    """The Flax variables dict the model is applied with (`matrix_dtype`: as for
    :meth:`model_params`)."""
    return {"params": self.model_params(matrix_dtype),
            **({FP8_COLLECTION: self.fp8} if self.fp8 else {})}


def state_init_fn(model, tx, level, batch_size: int, seq_len: int, seed: int, *,
                  comm_scaling: bool = False) -> Callable[[], TrainState]:
  """``() -> TrainState``: `model` initialised on int32[batch_size, seq_len] tokens with
  ``jax.random.key(seed)``, `tx`'s state, FP16 master weights where `level` keeps them, and
  with `comm_scaling` a fresh FP8 gradient-communication scaling state (one entry per
  parameter). Traceable: ``jax.eval_shape`` of it is the abstract state."""
  def init() -> TrainState:
    tokens = jnp.zeros((batch_size, seq_len), jnp.int32)
    variables = model.init(jax.random.key(seed), tokens)
    params = variables["params"]
    opt_state = tx.init(params)
    comm = init_grad_comm_scaling(params) if comm_scaling else ()
    if level.scaled_master:  # O2/O3: FP16 master weights
      params = init_master(params, level.master_dtype)
    return TrainState(jnp.zeros((), jnp.int32), params, variables.get(FP8_COLLECTION, {}),
                      opt_state, comm)
  return init


def init_state(model, tx, level, batch_size: int, seq_len: int, seed: int, *,
               comm_scaling: bool = False,
               shardings: Callable[[TrainState], Any] | None = None) -> TrainState:
  """A fresh TrainState (see :func:`state_init_fn`), computed in one jitted program.

  `shardings`: optional ``abstract state -> TrainState of shardings`` (e.g. from
  ``fp8jax.parallel.plan`` of the abstract state): every array is then created directly in
  its sharding, so no device ever holds the whole unsharded state. Default: one device.
  """
  init = state_init_fn(model, tx, level, batch_size, seq_len, seed, comm_scaling=comm_scaling)
  out = None if shardings is None else shardings(jax.eval_shape(init))
  return jax.jit(init, out_shardings=out)()


def load_params(state: TrainState, params, level, shardings) -> TrainState:
  """`state` with its parameters replaced by `params` (the model's params tree of arrays,
  e.g. numpy from a checkpoint, in the model's parameter dtype), placed on `shardings` (the
  plan's ``state.params``); FP16 master weights where `level` keeps them. The FP8 and
  optimizer state stay as they are (fresh). ValueError when the tree or a shape differs."""
  want = jax.eval_shape(state.model_params)
  got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), params)
  if jax.tree.structure(got) != jax.tree.structure(want):
    raise ValueError(f"the loaded params' tree differs from the model's: "
                     f"{jax.tree.structure(got)} vs {jax.tree.structure(want)}")
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree.leaves(want)):
    if g.shape != w.shape:
      raise ValueError(f"loaded param {jax.tree_util.keystr(path)} has shape {g.shape}; the "
                       f"model's is {w.shape}")
  as_state = functools.partial(init_master, dtype=level.master_dtype) if level.scaled_master \
      else (lambda p: jax.tree.map(lambda a, w: a.astype(w.dtype), p, want))
  return state._replace(params=jax.jit(as_state, out_shardings=shardings)(params))
