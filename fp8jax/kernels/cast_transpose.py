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
flows into its first GEMM.

With ``norm=(rstd, gain)`` the kernel casts RMSNorm's output ``rms_norm_apply(x, rstd,
gain)`` (x's rows scaled by rstd f32[B?, M], the statistic :func:`rms_norm_rstd` computes
outside, and its columns by gain f32[K], in f32, rounded to x's dtype): a pre-norm layer's
norm inside the cast of the next GEMM's input, so the normed tensor is never stored.

``activation="swiglu"`` is gated: x[.., 2F] holds (gate, up) pairs interleaved along its last
axis (column 2f the gate of hidden unit f, 2f + 1 its up value: an ``nn.DenseGeneral((F, 2))``
output flattened), and ``silu(gate) * up`` [.., F] is what the kernel casts; with
`activation_input` (the pairs [.., 2F]) and x the cotangent [.., F], it casts the gradient of
the pairs [.., 2F], interleaved the same way, so the first GEMM's weight gradient comes out in
the [D, F, 2] layout of its weight. Each program reads a tile of pairs once, as 32-bit words
(a bf16 pair each: bf16 inputs only), and writes the gradient's pairs as 16-bit words of two
FP8 bytes; the transposed copy [.., 2F, M] gets the gate and up rows of its hidden units.
On GPUs the kernel takes the GELU's tanh from the hardware's
``tanh.approx.f32`` (relative error at most ~2**-11, below the bf16 rounding of the result
that follows; the exact tanh makes the kernel compute-bound) and SwiGLU's sigmoid as
1 / (1 + exp(-x)) in f32; interpreted it computes exactly ``activate`` / ``activation_grad``.

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

# Tile sizes (the tile sweeps behind them: benchmarks/RESULTS.md, "Fused FP8
# cast+transpose+amax kernel" and "SwiGLU inside the FP8 cast kernel").
BLOCK_M = 64  # rows of x per program (columns of q_t); with BLOCK_K: 64 x 128 tiles, 4 warps
BLOCK_K = 128  # columns of x per program
GATED_BLOCK_M = 32  # the gated kernels' rows per program: 32 x 128 (gate, up) pairs, 4 warps
NUM_WARPS = 4
_INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_INTERPRET_ANYWHERE = False
ACTIVATIONS = ("gelu", "swiglu")
# Gated activations: the input's last axis holds interleaved (gate, up) pairs, 2F -> F.
GATED = ("swiglu",)


# Triton addresses the kernel's elements with 32-bit offsets: larger inputs take the XLA path.
MAX_ELEMENTS = 2**31 - 1


def check_activation(activation: str | None) -> None:
  """Raises ValueError unless `activation` is None or one of ACTIVATIONS."""
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r} is not allowed; use one of {list(ACTIVATIONS)} "
                     "or None")


def activated_width(k: int, activation: str | None) -> int:
  """The last axis of ``activate(x, activation)`` for x[.., k]: k // 2 for a gated activation
  (ValueError when k is odd), else k."""
  check_activation(activation)
  if activation not in GATED:
    return k
  if k % 2:
    raise ValueError(f"activation={activation!r} takes interleaved (gate, up) pairs: the last "
                     f"axis must be even, got {k}")
  return k // 2


def _pairs(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(gate, up) of x[.., 2F] (interleaved pairs) in f32, each [.., F]."""
  x = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
  return x[..., 0], x[..., 1]


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up (f32)."""
  return jax.nn.silu(gate) * up


def _swiglu_grad(dy: jax.Array, gate: jax.Array, up: jax.Array):
  """(d gate, d up) of :func:`_swiglu` given its cotangent dy (f32)."""
  return jax.vjp(_swiglu, gate, up)[1](dy)


def activate(x: jax.Array, activation: str | None) -> jax.Array:
  """`activation` of x computed in f32 and rounded to x's dtype (None: x itself). "gelu":
  GELU's tanh form, same shape; "swiglu": ``silu(gate) * up`` of the interleaved pairs of
  x[.., 2F], [.., F]."""
  activated_width(x.shape[-1], activation)
  if activation is None:
    return x
  if activation == "swiglu":
    return _swiglu(*_pairs(x)).astype(x.dtype)
  return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def activation_grad(dy: jax.Array, x: jax.Array, activation: str | None) -> jax.Array:
  """The gradient with respect to x of ``activate(x, activation)`` given its cotangent dy
  (shaped like the activation's output): computed in f32, rounded to x's dtype, shaped like x
  (None: dy itself)."""
  activated_width(x.shape[-1], activation)
  if activation is None:
    return dy
  if activation == "swiglu":
    d_gate, d_up = _swiglu_grad(dy.astype(x.dtype).astype(jnp.float32), *_pairs(x))
    return jnp.stack([d_gate, d_up], -1).reshape(x.shape).astype(x.dtype)
  return jax.vjp(lambda v: activate(v, activation), x)[1](dy.astype(x.dtype))[0]


def rms_norm_rstd(x: jax.Array, eps: float) -> jax.Array:
  """f32[...]: RMSNorm's ``rsqrt(mean(x^2) + eps)`` of each row of x[..., K] (f32 math)."""
  x = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(jax.lax.square(x), axis=-1) + jnp.float32(eps))


def rms_norm_apply(x: jax.Array, rstd: jax.Array, gain: jax.Array) -> jax.Array:
  """``x * (rstd * gain)`` in f32, rounded to x's dtype: x[..., K], rstd f32[...] (one per
  row), gain [K]; flax's ``nn.RMSNorm`` (f32 math) once rstd is :func:`rms_norm_rstd`'s."""
  mul = rstd.astype(jnp.float32)[..., None] * gain.astype(jnp.float32)
  return (x.astype(jnp.float32) * mul).astype(x.dtype)


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
  """RMSNorm of x[..., K] with gain [K] and epsilon `eps`, computed in f32 and rounded to x's
  dtype: the values of ``nn.RMSNorm(epsilon=eps, dtype=float32)`` on x in f32, rounded."""
  x32 = x.astype(jnp.float32)  # one conversion: its cotangent is rounded once, as flax's
  return rms_norm_apply(x32, rms_norm_rstd(x32, eps), gain).astype(x.dtype)


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


def cast_operand(x, activation: str | None = None, activation_input=None, norm=None):
  """What the cast casts: x, ``activate(x)``, or with `activation_input` the gradient
  ``activation_grad(x, activation_input)`` (x: the cotangent of the activated tensor); with
  ``norm=(rstd, gain)`` (no activation) :func:`rms_norm_apply` of x."""
  if norm is not None:
    if activation is not None or activation_input is not None:
      raise ValueError("norm is applied alone (no activation or activation_input with it)")
    return rms_norm_apply(x, *norm)
  if activation_input is None:
    return activate(x, activation)
  return activation_grad(x, activation_input, activation)


def cast_transpose_reference(x: jax.Array, scale: jax.Array, fmt, activation: str | None = None,
                             activation_input: jax.Array | None = None, norm=None):
  """(q, q_t, amax) computed by plain XLA ops: scaling.quantize, a transpose of its result
  (XLA may fuse it into a second cast) and scaling.compute_amax (of :func:`cast_operand`'s
  tensor: ``activate(x)``, the activation's gradient, or RMSNorm's output)."""
  x = cast_operand(x, activation, activation_input, norm)
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


def _clip_keeping_nan(y: jax.Array, bound: float) -> jax.Array:
  """y clipped to [-bound, bound], NaN kept. Two selects on comparisons, which are false for
  NaN: Triton lowers min/max to minnum/maxnum, which would drop NaN, as XLA does not (NaN
  payload and sign bits may differ from XLA's: compare NaN positions, not bits)."""
  # (Compared with the Python float: a NumPy scalar operand fails Triton's lowering.)
  return jnp.where(y > bound, jnp.float32(bound), jnp.where(y < -bound, jnp.float32(-bound), y))


def _abs_bits(x: jax.Array) -> jax.Array:
  """int32 bits of |x| (f32): ordered as the values are, every NaN above +inf."""
  return jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)


def _tile_amax(*xs: jax.Array) -> jax.Array:
  """max |x| over the f32 tiles `xs`, NaN when any element is NaN: one integer max of the
  magnitudes' bits (a float max would drop NaN on the GPU, see :func:`_clip_keeping_nan`)."""
  bits = functools.reduce(jnp.maximum, [jnp.max(_abs_bits(x)) for x in xs])
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _kernel(inv_ref, x_ref, *refs, bound: float, activation: str | None, approx: bool,
            with_input: bool, with_norm: bool):
  act_in = refs[0][...] if with_input else None  # the activation's input (gradient casts)
  refs = refs[1:] if with_input else refs
  if with_norm:  # RMSNorm: the rows' rstd [block_m] and the gain's columns [block_k]
    x = rms_norm_apply(x_ref[...], refs[0][...], refs[1][...])
    refs = refs[2:]
  else:
    x = _prologue_in_kernel(x_ref[...], activation, act_in, approx)
  q_ref, qt_ref, amax_ref = refs
  inv = inv_ref[...]  # f32[]: 1 / scale, computed by XLA exactly as scaling.quantize does
  x = x.astype(jnp.float32)
  c = _clip_keeping_nan(x * inv, bound)
  q_ref[...] = c.astype(q_ref.dtype)
  qt_ref[...] = c.T.astype(qt_ref.dtype)  # transpose in f32, then cast (no 8-bit shuffles)
  amax_ref[...] = _tile_amax(x)


def _unpack_pairs(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(gate, up) f32 tiles of uint32 words, each a (gate, up) pair of bf16 values in memory
  order (gate in the low half); a bf16 is the upper half of its f32."""
  gate = jax.lax.bitcast_convert_type(jax.lax.shift_left(words, jnp.uint32(16)), jnp.float32)
  up = jax.lax.bitcast_convert_type(jax.lax.bitwise_and(words, jnp.uint32(0xFFFF0000)),
                                    jnp.float32)
  return gate, up


def _sigmoid(x: jax.Array) -> jax.Array:
  """1 / (1 + exp(-x)) in f32 (inside the GPU kernel)."""
  return 1.0 / (1.0 + jnp.exp(-x))


def _swiglu_kernel(inv_ref, words_ref, q_ref, qt_ref, amax_ref, *, bound: float, approx: bool,
                   dtype):
  gate, up = _unpack_pairs(words_ref[...])
  h = gate * _sigmoid(gate) * up if approx else _swiglu(gate, up)
  x = h.astype(dtype).astype(jnp.float32)  # rounded as the stored activation would be
  c = _clip_keeping_nan(x * inv_ref[...], bound)
  q_ref[...] = c.astype(q_ref.dtype)
  qt_ref[...] = c.T.astype(qt_ref.dtype)
  amax_ref[...] = _tile_amax(x)


def _fp8_byte(c: jax.Array, fmt) -> jax.Array:
  """The FP8 bits of c (f32, already clipped) as uint16 values 0..255."""
  return jax.lax.bitcast_convert_type(c.astype(fmt), jnp.uint8).astype(jnp.uint16)


def _swiglu_grad_kernel(inv_ref, dy_ref, words_ref, q_ref, qt_ref, amax_ref, *, bound: float,
                        approx: bool, dtype, fmt, m: int, block_m: int, block_k: int):
  from jax.experimental import pallas as pl
  b, i, j = (pl.program_id(a) for a in range(3))
  dy = dy_ref[...].astype(dtype).astype(jnp.float32)
  gate, up = _unpack_pairs(words_ref[...])
  if approx:
    s = _sigmoid(gate)
    d_gate, d_up = dy * up * (s * (1.0 + gate * (1.0 - s))), dy * (gate * s)
  else:
    d_gate, d_up = _swiglu_grad(dy, gate, up)
  d_gate, d_up = (v.astype(dtype).astype(jnp.float32) for v in (d_gate, d_up))
  inv = inv_ref[...]
  c_gate, c_up = _clip_keeping_nan(d_gate * inv, bound), _clip_keeping_nan(d_up * inv, bound)
  # q[.., m, 2f + h] as 16-bit words [.., m, f]: the gate's byte first in memory.
  q_ref[...] = _fp8_byte(c_gate, fmt) | jax.lax.shift_left(_fp8_byte(c_up, fmt), jnp.uint16(8))
  # q_t [B, F, 2M]: row f holds the gate's gradient over all M tokens, then the up's, i.e. rows
  # 2f and 2f + 1 of q_t [B, 2F, M].
  rows = pl.ds(j * block_k, block_k)
  qt_ref[b, rows, pl.ds(i * block_m, block_m)] = c_gate.T.astype(fmt)
  qt_ref[b, rows, pl.ds(m + i * block_m, block_m)] = c_up.T.astype(fmt)
  amax_ref[...] = _tile_amax(d_gate, d_up)


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
                        block_m: int | None = None, block_k: int = BLOCK_K,
                        num_warps: int = NUM_WARPS, num_stages: int | None = None,
                        activation: str | None = None,
                        activation_input: jax.Array | None = None, norm=None):
  """The Pallas kernel: x[B?, M, K], scale f32[] -> (q[B?, M, K], q_t[B?, K, M], amax f32[])
  of x, or of ``rms_norm_apply(x, *norm)`` (``norm=(rstd f32[B?, M], gain [K])``), or of
  ``activate(x, activation)``, or with `activation_input` of the gradient
  ``activation_grad(x, activation_input, activation)`` (x is then the cotangent of the
  activated tensor; rounded to activation_input's dtype; q, q_t shaped like
  activation_input). A gated activation ("swiglu") takes bf16 pairs x[B?, M, 2F] to
  q[B?, M, F]; its gradient, x[B?, M, F] with the pairs as `activation_input`, is cast to
  q[B?, M, 2F] (interleaved like the pairs). Compiled for the GPU GELU's tanh is the
  approximate one (see the module docstring); interpreted, the math is exactly
  ``activate`` / ``activation_grad``'s.

  M must be a multiple of `block_m` (default BLOCK_M; gated: GATED_BLOCK_M) and K (gated: F)
  of `block_k` (see :func:`kernel_reason`).
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  _check(x, fmt)
  check_activation(activation)
  fmt = np.dtype(fmt).type
  if norm is not None and (activation is not None or activation_input is not None):
    raise ValueError("cast_transpose_amax: norm is applied alone (no activation with it)")
  block_m = block_m or (GATED_BLOCK_M if activation in GATED else BLOCK_M)
  if activation in GATED:
    return _gated_cast(x, scale, fmt, interpret, block_m, block_k, num_warps, num_stages,
                       activation_input)
  x3 = x if x.ndim == 3 else x[None]
  b, m, k = x3.shape
  if m % block_m or k % block_k:
    raise ValueError(f"cast_transpose_amax: (M, K)=({m}, {k}) is not a multiple of the block "
                     f"({block_m}, {block_k})")
  gm, gk = m // block_m, k // block_k
  inv = (1.0 / jnp.asarray(scale, jnp.float32)).reshape(1)  # as scaling.quantize computes it
  with_input = activation_input is not None
  tile = pl.BlockSpec((None, block_m, block_k), lambda i, j, l: (i, j, l))
  inputs, specs = (inv, x3), [pl.BlockSpec((None,), lambda i, j, l: (0,)), tile]
  if with_input:
    if activation is None or activation_input.shape != x.shape:
      raise ValueError(f"cast_transpose_amax: activation_input needs an activation and x's "
                       f"shape {x.shape}, got activation={activation!r}, shape "
                       f"{activation_input.shape}")
    _check(activation_input, fmt)
    inputs += (activation_input if x.ndim == 3 else activation_input[None],)
    specs.append(tile)
  if norm is not None:
    rstd, gain = norm
    if rstd.shape != x.shape[:-1] or gain.shape != (k,):
      raise ValueError(f"cast_transpose_amax: norm=(rstd, gain) must be shaped "
                       f"{list(x.shape[:-1])} and [{k}] for x{list(x.shape)}, got "
                       f"{list(rstd.shape)} and {list(gain.shape)}")
    inputs += (jnp.asarray(rstd, jnp.float32).reshape(b, m), jnp.asarray(gain, jnp.float32))
    specs += [pl.BlockSpec((None, block_m), lambda i, j, l: (i, j)),
              pl.BlockSpec((block_k,), lambda i, j, l: (l,))]
  q, qt, partial = pl.pallas_call(
      functools.partial(_kernel, bound=scaling.fp8_max(fmt), activation=activation,
                        approx=not interpret, with_input=with_input, with_norm=norm is not None),
      out_shape=(jax.ShapeDtypeStruct((b, m, k), fmt), jax.ShapeDtypeStruct((b, k, m), fmt),
                 jax.ShapeDtypeStruct((b, gm, gk), jnp.float32)),
      grid=(b, gm, gk),
      in_specs=specs,
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


def _gated_cast(x, scale, fmt, interpret: bool, block_m: int, block_k: int, num_warps: int,
                num_stages: int | None, activation_input):
  """cast_transpose_amax of a gated activation (x: the pairs [B?, M, 2F], or with
  `activation_input` the pairs and x the cotangent [B?, M, F])."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  grad = activation_input is not None
  pairs = activation_input if grad else x
  if np.dtype(pairs.dtype) != np.dtype(jnp.bfloat16):
    raise TypeError(f"cast_transpose_amax: a gated activation reads bf16 pairs, got "
                    f"{pairs.dtype}")
  p3 = pairs if pairs.ndim == 3 else pairs[None]
  b, m, k2 = p3.shape
  f = activated_width(k2, "swiglu")
  if grad:
    _check(activation_input, fmt)
    if x.shape != pairs.shape[:-1] + (f,):
      raise ValueError(f"cast_transpose_amax: the cotangent of a gated activation must be "
                       f"{list(pairs.shape[:-1] + (f,))}, got {list(x.shape)}")
  if m % block_m or f % block_k:
    raise ValueError(f"cast_transpose_amax: (M, F)=({m}, {f}) is not a multiple of the block "
                     f"({block_m}, {block_k})")
  gm, gk = m // block_m, f // block_k
  words = jax.lax.bitcast_convert_type(p3.reshape(b, m, f, 2), jnp.uint32)  # [B, M, F]
  inv = (1.0 / jnp.asarray(scale, jnp.float32)).reshape(1)
  tile = pl.BlockSpec((None, block_m, block_k), lambda i, j, l: (i, j, l))
  amax_spec = pl.BlockSpec((None, None, None), lambda i, j, l: (i, j, l))
  partial_shape = jax.ShapeDtypeStruct((b, gm, gk), jnp.float32)
  params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  bound = scaling.fp8_max(fmt)
  if not grad:
    q, qt, partial = pl.pallas_call(
        functools.partial(_swiglu_kernel, bound=bound, approx=not interpret,
                          dtype=jnp.bfloat16),
        out_shape=(jax.ShapeDtypeStruct((b, m, f), fmt), jax.ShapeDtypeStruct((b, f, m), fmt),
                   partial_shape),
        grid=(b, gm, gk),
        in_specs=[pl.BlockSpec((None,), lambda i, j, l: (0,)), tile],
        out_specs=(tile, pl.BlockSpec((None, block_k, block_m), lambda i, j, l: (i, l, j)),
                   amax_spec),
        compiler_params=params, interpret=interpret, name="fp8_cast_transpose_amax_swiglu",
    )(inv, words)
  else:
    dy3 = x if x.ndim == 3 else x[None]
    q16, qt, partial = pl.pallas_call(
        functools.partial(_swiglu_grad_kernel, bound=bound, approx=not interpret,
                          dtype=jnp.bfloat16, fmt=fmt, m=m, block_m=block_m, block_k=block_k),
        out_shape=(jax.ShapeDtypeStruct((b, m, f), jnp.uint16),
                   jax.ShapeDtypeStruct((b, f, 2 * m), fmt), partial_shape),
        grid=(b, gm, gk),
        in_specs=[pl.BlockSpec((None,), lambda i, j, l: (0,)), tile, tile],
        out_specs=(tile, pl.no_block_spec, amax_spec),
        compiler_params=params, interpret=interpret,
        name="fp8_cast_transpose_amax_swiglu_grad",
    )(inv, dy3, words)
    q = jax.lax.bitcast_convert_type(q16, fmt).reshape(b, m, 2 * f)
    qt = qt.reshape(b, 2 * f, m)
  if pairs.ndim == 2:
    q, qt = q[0], qt[0]
  return q, qt, jnp.max(partial)


def kernel_reason(shape, dtype, fmt, *, block_m: int | None = None, block_k: int = BLOCK_K,
                  activation: str | None = None) -> str | None:
  """None when the kernel runs for x of `shape`/`dtype` here, else why not. With a gated
  `activation`, `shape`/`dtype` are those of the (gate, up) pairs [B?, M, 2F], whether the
  kernel casts the activation or (given the pairs as its input) their gradient."""
  if len(shape) not in (2, 3):
    return f"shape {tuple(shape)} is not [M, K] or [B, M, K]"
  if np.dtype(dtype) not in [np.dtype(d) for d in _INPUT_DTYPES]:
    return f"input dtype {np.dtype(dtype).name} is not bf16/f16/f32"
  if np.dtype(fmt) not in [np.dtype(d) for d in _FP8_DTYPES]:
    return f"format {np.dtype(fmt).name} is not float8_e4m3fn/float8_e5m2"
  block_m = block_m or (GATED_BLOCK_M if activation in GATED else BLOCK_M)
  if activation in GATED:
    if np.dtype(dtype) != np.dtype(jnp.bfloat16):
      return f"{activation} reads bf16 (gate, up) pairs, got {np.dtype(dtype).name}"
    if shape[-1] % (2 * block_k):
      return (f"{activation}'s hidden width {shape[-1] / 2:g} is not a multiple of the block "
              f"({block_k})")
  m, k = shape[-2:]
  if int(np.prod(shape, dtype=np.int64)) > MAX_ELEMENTS:
    return f"{int(np.prod(shape, dtype=np.int64))} elements need 64-bit offsets (> 2**31 - 1)"
  if m % block_m or k % block_k:
    return f"(M, K)=({m}, {k}) is not a multiple of the block ({block_m}, {block_k})"
  if not _INTERPRET_ANYWHERE and jax.default_backend() != "gpu":
    return f"backend {jax.default_backend()!r} is not gpu"
  return None

