"""XLA settings fp8jax applies to the process before the XLA backend starts.

XLA reads ``XLA_FLAGS`` once, when the first backend initialises (the first ``jax.devices()``,
array or compile), not at ``import jax``. ``import fp8jax`` calls :func:`apply_xla_defaults`,
which appends :data:`DEFAULT_FLAGS` to ``os.environ["XLA_FLAGS"]``, each only when the user's
``XLA_FLAGS`` does not mention that flag's name, and none when :data:`OPT_OUT` is set (to
anything but "", "0" or "false"). For the flags to take effect, import fp8jax before anything
touches a device; the ``fp8jax`` command does.

* ``--xla_gpu_enable_triton_gemm=false``: cuBLAS(Lt) runs every GEMM. With Triton GEMMs on,
  XLA autotunes Triton kernels for every GEMM shape of the first compile (a minute or more
  at the configs' sizes), and the FP8 and BF16 GEMMs of fp8jax's models are cuBLAS(Lt)'s
  anyway. XLA's CPU backend parses the flag and ignores it.
* ``--xla_cpu_enable_concurrency_optimized_scheduler=false``: on CPU devices (tests, and
  rehearsing a multi-device run on one machine), XLA's concurrency-optimized scheduler lets
  the devices' threads enter independent collectives in different orders; with few cores
  such a step (seen: a pipeline with FP8 gradient communication and ZeRO stage 1 or 2 at
  O2) deadlocks until XLA's 40 s rendezvous timeout aborts the process. XLA's GPU backend
  parses the flag and ignores it.

This module imports only the standard library, so importing it cannot start a backend.
"""
from __future__ import annotations

import os
from typing import Mapping, MutableMapping

OPT_OUT = "FP8JAX_NO_XLA_DEFAULTS"
DEFAULT_FLAGS = ("--xla_gpu_enable_triton_gemm=false",
                 "--xla_cpu_enable_concurrency_optimized_scheduler=false")

_APPLIED: tuple[str, ...] = ()


def _flag_name(flag: str) -> str:
  """"--xla_gpu_enable_triton_gemm=false" -> "xla_gpu_enable_triton_gemm"."""
  return flag.lstrip("-").split("=", 1)[0]


def opted_out(environ: Mapping[str, str]) -> bool:
  """Whether `environ` sets :data:`OPT_OUT` (any value but "", "0" or "false")."""
  return environ.get(OPT_OUT, "").strip().lower() not in ("", "0", "false")


def flags_to_add(environ: Mapping[str, str]) -> tuple[str, ...]:
  """The :data:`DEFAULT_FLAGS` fp8jax would append to `environ`'s ``XLA_FLAGS``: those whose
  name it does not mention; none when `environ` opts out (:func:`opted_out`)."""
  if opted_out(environ):
    return ()
  current = environ.get("XLA_FLAGS", "")
  return tuple(f for f in DEFAULT_FLAGS if _flag_name(f) not in current)


def apply_xla_defaults(environ: MutableMapping[str, str] | None = None) -> tuple[str, ...]:
  """Appends :func:`flags_to_add` to ``XLA_FLAGS`` in `environ` (default ``os.environ``);
  returns the flags added (also kept for :func:`applied_flags` when `environ` is
  ``os.environ``). Calling it again adds nothing."""
  global _APPLIED
  real = environ is None or environ is os.environ
  environ = os.environ if environ is None else environ
  added = flags_to_add(environ)
  if added:
    environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", "").strip(), *added]).strip()
    if real:
      _APPLIED = _APPLIED + added
  return added


def applied_flags() -> tuple[str, ...]:
  """The flags fp8jax appended to this process's ``XLA_FLAGS`` (empty: none)."""
  return _APPLIED


def applied_line() -> str | None:
  """One line for a run's start log naming the flags fp8jax added and how to opt out; None
  when it added none."""
  if not _APPLIED:
    return None
  return (f"XLA_FLAGS += {' '.join(_APPLIED)} (set by fp8jax: cuBLAS runs every GEMM, no "
          f"Triton autotuning; CPU devices enter collectives in one order; {OPT_OUT}=1 or your "
          f"own XLA_FLAGS value keeps XLA's defaults)")
