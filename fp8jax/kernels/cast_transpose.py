"""Fused FP8 cast + transpose + amax: one pass over x instead of three (TransformerEngine's
cast_transpose, as a Pallas kernel on the Triton backend).

`cast_transpose_amax(x, scale, fmt)` returns, for x[B?, M, K] (bf16 / f16 / f32):
  q[B?, M, K]   = scaling.quantize(x, scale, fmt)   (bit-identical: same f32 math and clipping)
  q_t[B?, K, M] = q transposed over its last two axes (the K-major copy cuBLASLt's FP8 GEMMs
                  need for the weight gradient)
  amax f32[]    = scaling.compute_amax(x)           (max |x|; NaN if any element is NaN)
Each (block_m x block_k) tile is loaded once; its f32 max |x| goes to a small [B, M/bm, K/bk]
array that jnp.max reduces outside the kernel.

With ``activation="gelu"`` the kernel casts ``activate(x, "gelu")`` instead of x (GELU's tanh
form computed in f32 and rounded to x's dtype, as the stored activation would be), so the
activation of an MLP is never written to memory in bf16; q, q_t and amax are those of the
activated tensor. With ``activation_input`` (the activation's input, shaped like x) it casts
the gradient ``activation_grad(x, activation_input)`` instead, x being the cotangent of the
activated tensor: an MLP's activation derivative applied inside the cast of the gradient that
flows into its first GEMM. On GPUs the kernel takes the tanh from the hardware's
``tanh.approx.f32`` (relative error at most ~2**-11, below the bf16 rounding of the result
that follows; the exact tanh makes the kernel compute-bound); interpreted it computes exactly
``activate`` / ``activation_grad``.

The kernel runs on GPUs (Triton lowering; FP8 stores need sm_89+); `interpret=True` runs it
through Pallas' interpreter anywhere (tests). :func:`kernel_reason` says where the kernel
runs; elsewhere :func:`cast_transpose_reference` computes the same values with plain XLA.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import scaling

BLOCK_M = 64  # rows of x per program (columns of q_t); 64x128 tiles, 4 warps: fastest on an H200
BLOCK_K = 128  # columns of x per program
NUM_WARPS = 4
_INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_INTERPRET_ANYWHERE = False
ACTIVATIONS = ("gelu",)


# Triton addresses the kernel's elements with 32-bit offsets: larger inputs take the XLA path.
MAX_ELEMENTS = 2**31 - 1


def check_activation(activation: str | None) -> None:
  """Raises ValueError unless `activation` is None or one of ACTIVATIONS."""
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r} is not allowed; use one of {list(ACTIVATIONS)} "
                     "or None")


def activate(x: jax.Array, activation: str | None) -> jax.Array:
  """`activation` of x computed in f32 and rounded to x's dtype (None: x itself)."""
  check_activation(activation)
  if activation is None:
    return x
  return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def activation_grad(dy: jax.Array, x: jax.Array, activation: str | None) -> jax.Array:
  """The gradient with respect to x of ``activate(x, activation)`` given its cotangent dy (same
  shape): computed in f32, rounded to x's dtype (None: dy itself)."""
  check_activation(activation)
  if activation is None:
    return dy
  return jax.vjp(lambda v: activate(v, activation), x)[1](dy.astype(x.dtype))[0]


@contextlib.contextmanager
def interpret_anywhere(on: bool = True):
  """While active (at trace time), :func:`kernel_reason` allows the kernel on any backend, run
  through Pallas' interpreter off GPUs: lets CPU tests exercise the fused path end to end."""
  global _INTERPRET_ANYWHERE
  prev, _INTERPRET_ANYWHERE = _INTERPRET_ANYWHERE, on
  try:
    yield
  finally:
    _INTERPRET_ANYWHERE = prev


def interpreting_anywhere() -> bool:
  """True inside :func:`interpret_anywhere`."""
  return _INTERPRET_ANYWHERE


def cast_operand(x, activation: str | None = None, activation_input=None):
  """What the cast casts: x, ``activate(x)``, or with `activation_input` the gradient
  ``activation_grad(x, activation_input)`` (x: the cotangent of the activated tensor)."""
  if activation_input is None:
    return activate(x, activation)
  return activation_grad(x, activation_input, activation)


def cast_transpose_reference(x: jax.Array, scale: jax.Array, fmt, activation: str | None = None,
                             activation_input: jax.Array | None = None):
  """(q, q_t, amax) computed by plain XLA ops: scaling.quantize, a transpose of its result
  (XLA may fuse it into a second cast) and scaling.compute_amax (of ``activate(x)``, or with
  `activation_input` of ``activation_grad(x, activation_input)``)."""
  x = cast_operand(x, activation, activation_input)
  q = scaling.quantize(x, scale, fmt)
  return q, jnp.swapaxes(q, -1, -2), scaling.compute_amax(x)


_GELU_C = np.float32(np.sqrt(2 / np.pi))  # GELU's tanh form: tanh(C * (x + 0.044715 x^3))


def _gelu_tanh_approx(x: jax.Array) -> jax.Array:
  """GELU's tanh term with the GPU's ``tanh.approx.f32`` (inside a Pallas Triton kernel only;
  x f32)."""
  from jax.experimental.pallas import triton as plt
  return plt.approx_tanh(_GELU_C * (x + 0.044715 * (x ** 3)))


def gelu_approx_tanh(x: jax.Array) -> jax.Array:
  """jax.nn.gelu(x, approximate=True)'s expression with the approximate tanh (x f32)."""
  return x * (0.5 * (1.0 + _gelu_tanh_approx(x)))


def gelu_grad_approx_tanh(dy: jax.Array, x: jax.Array) -> jax.Array:
  """dy * gelu'(x) for GELU's tanh form, with the approximate tanh (dy, x f32)."""
  t = _gelu_tanh_approx(x)
  return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x))


def _prologue_in_kernel(x: jax.Array, activation: str | None, activation_input,
                        approx: bool) -> jax.Array:
  """:func:`cast_operand` of loaded tiles, with the approximate tanh when `approx` (on the GPU)."""
  if activation != "gelu" or not approx:  # (only GELU has an approximate form)
    return cast_operand(x, activation, activation_input)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  if activation_input is None:
    return gelu_approx_tanh(f32(x)).astype(x.dtype)
  return gelu_grad_approx_tanh(f32(x), f32(activation_input)).astype(activation_input.dtype)


def _kernel(inv_ref, x_ref, *refs, bound: float, activation: str | None, approx: bool,
            with_input: bool):
  act_in = refs[0][...] if with_input else None  # the activation's input (gradient casts)
  q_ref, qt_ref, amax_ref = refs[1:] if with_input else refs
  inv = inv_ref[...]  # f32[]: 1 / scale, computed by XLA exactly as scaling.quantize does
  x = _prologue_in_kernel(x_ref[...], activation, act_in, approx).astype(jnp.float32)
  y = x * inv
  # Triton lowers min/max to minnum/maxnum (NaN dropped): keep NaN explicitly, as XLA does
  # (NaN payload and sign bits may differ from XLA's: compare NaN positions, not bits).
  c = jnp.where(jnp.isnan(y), jnp.float32(jnp.nan), jnp.minimum(jnp.maximum(y, -bound), bound))
  q_ref[...] = c.astype(q_ref.dtype)
  qt_ref[...] = c.T.astype(qt_ref.dtype)  # transpose in f32, then cast (no 8-bit shuffles)
  a = jnp.abs(x)
  has_nan = jnp.max(jnp.where(jnp.isnan(a), 1.0, 0.0))
  amax_ref[...] = jnp.where(has_nan > 0, jnp.float32(jnp.nan), jnp.max(a))


def _check(x, fmt):
  if x.ndim not in (2, 3):
    raise ValueError(f"cast_transpose_amax: x must be [M, K] or [B, M, K], got shape {x.shape}")
  if np.dtype(x.dtype) not in [np.dtype(d) for d in _INPUT_DTYPES]:
    raise TypeError(f"cast_transpose_amax: x.dtype={x.dtype} is not allowed; use bfloat16, "
                    "float16 or float32")
  if np.dtype(fmt) not in [np.dtype(d) for d in _FP8_DTYPES]:
    raise TypeError(f"cast_transpose_amax: dtype={np.dtype(fmt).name} is not allowed; use "
                    "float8_e4m3fn or float8_e5m2")


@functools.partial(jax.jit, static_argnames=("fmt", "interpret", "block_m", "block_k",
                                             "num_warps", "num_stages", "activation"))
def cast_transpose_amax(x: jax.Array, scale: jax.Array, fmt, *, interpret: bool = False,
                        block_m: int = BLOCK_M, block_k: int = BLOCK_K,
                        num_warps: int = NUM_WARPS, num_stages: int | None = None,
                        activation: str | None = None,
                        activation_input: jax.Array | None = None):
  """The Pallas kernel: x[B?, M, K], scale f32[] -> (q[B?, M, K], q_t[B?, K, M], amax f32[])
  of x, or of ``activate(x, activation)``, or with `activation_input` (shaped like x) of the
  gradient ``activation_grad(x, activation_input, activation)`` (x is then the cotangent of
  the activated tensor; rounded to activation_input's dtype). Compiled for the GPU the
  activation's tanh is the approximate one (see the module docstring); interpreted, exact.

  M must be a multiple of `block_m` and K of `block_k` (see :func:`kernel_reason`).
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  _check(x, fmt)
  check_activation(activation)
  fmt = np.dtype(fmt).type
  x3 = x if x.ndim == 3 else x[None]
  b, m, k = x3.shape
  if m % block_m or k % block_k:
    raise ValueError(f"cast_transpose_amax: (M, K)=({m}, {k}) is not a multiple of the block "
                     f"({block_m}, {block_k})")
  gm, gk = m // block_m, k // block_k
  inv = (1.0 / jnp.asarray(scale, jnp.float32)).reshape(1)  # as scaling.quantize computes it
  with_input = activation_input is not None
  tile = pl.BlockSpec((None, block_m, block_k), lambda i, j, l: (i, j, l))
  inputs = (inv, x3)
  if with_input:
    if activation is None or activation_input.shape != x.shape:
      raise ValueError(f"cast_transpose_amax: activation_input needs an activation and x's "
                       f"shape {x.shape}, got activation={activation!r}, shape "
                       f"{activation_input.shape}")
    _check(activation_input, fmt)
    inputs += (activation_input if x.ndim == 3 else activation_input[None],)
  q, qt, partial = pl.pallas_call(
      functools.partial(_kernel, bound=scaling.fp8_max(fmt), activation=activation,
                        approx=not interpret, with_input=with_input),
      out_shape=(jax.ShapeDtypeStruct((b, m, k), fmt), jax.ShapeDtypeStruct((b, k, m), fmt),
                 jax.ShapeDtypeStruct((b, gm, gk), jnp.float32)),
      grid=(b, gm, gk),
      in_specs=[pl.BlockSpec((None,), lambda i, j, l: (0,))] + [tile] * (len(inputs) - 1),
      out_specs=(pl.BlockSpec((None, block_m, block_k), lambda i, j, l: (i, j, l)),
                 pl.BlockSpec((None, block_k, block_m), lambda i, j, l: (i, l, j)),
                 pl.BlockSpec((None, None, None), lambda i, j, l: (i, j, l))),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="fp8_cast_transpose_amax",
  )(*inputs)
  if x.ndim == 2:
    q, qt = q[0], qt[0]
  return q, qt, jnp.max(partial)


def kernel_reason(shape, dtype, fmt, *, block_m: int = BLOCK_M,
                  block_k: int = BLOCK_K) -> str | None:
  """None when the kernel runs for x of `shape`/`dtype` here, else why not."""
  if len(shape) not in (2, 3):
    return f"shape {tuple(shape)} is not [M, K] or [B, M, K]"
  if np.dtype(dtype) not in [np.dtype(d) for d in _INPUT_DTYPES]:
    return f"input dtype {np.dtype(dtype).name} is not bf16/f16/f32"
  if np.dtype(fmt) not in [np.dtype(d) for d in _FP8_DTYPES]:
    return f"format {np.dtype(fmt).name} is not float8_e4m3fn/float8_e5m2"
  m, k = shape[-2:]
  if int(np.prod(shape, dtype=np.int64)) > MAX_ELEMENTS:
    return f"{int(np.prod(shape, dtype=np.int64))} elements need 64-bit offsets (> 2**31 - 1)"
  if m % block_m or k % block_k:
    return f"(M, K)=({m}, {k}) is not a multiple of the block ({block_m}, {block_k})"
  if not _INTERPRET_ANYWHERE and jax.default_backend() != "gpu":
    return f"backend {jax.default_backend()!r} is not gpu"
  return None

