"""XLA flags set by `import fp8jax` (no Triton GEMMs; CPU devices enter collectives in one
order) appended to XLA_FLAGS before any backend starts, unless the user's XLA_FLAGS names a
flag or they opt out."""
import ast
import os
import subprocess
import sys

import pytest

from fp8jax import xla_env

FLAG = "--xla_gpu_enable_triton_gemm=false"
CPU_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
BOTH = f"{FLAG} {CPU_FLAG}"
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("environ,expected,added", [
    ({}, BOTH, (FLAG, CPU_FLAG)),
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}, f"--xla_dump_to=/tmp/x {BOTH}", (FLAG, CPU_FLAG)),
    ({"XLA_FLAGS": "  "}, BOTH, (FLAG, CPU_FLAG)),
    ({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"},
     f"--xla_gpu_enable_triton_gemm=true {CPU_FLAG}", (CPU_FLAG,)),
    ({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm"}, f"--xla_gpu_enable_triton_gemm {CPU_FLAG}",
     (CPU_FLAG,)),
    ({"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"},
     f"--xla_cpu_enable_concurrency_optimized_scheduler=true {FLAG}", (FLAG,)),
    ({xla_env.OPT_OUT: "1"}, None, ()),
    ({xla_env.OPT_OUT: "yes", "XLA_FLAGS": "--a=1"}, "--a=1", ()),
    ({xla_env.OPT_OUT: "0"}, BOTH, (FLAG, CPU_FLAG)),
    ({xla_env.OPT_OUT: "false"}, BOTH, (FLAG, CPU_FLAG)),
    ({xla_env.OPT_OUT: ""}, BOTH, (FLAG, CPU_FLAG)),
])
def test_flags_added_to_an_environment(environ, expected, added):
  env = dict(environ)
  assert xla_env.apply_xla_defaults(env) == added
  assert env.get("XLA_FLAGS") == expected
  assert xla_env.apply_xla_defaults(env) == () and env.get("XLA_FLAGS") == expected  # once


def _import_fp8jax(env_changes: dict) -> tuple[str, str]:
  """(XLA_FLAGS after `import fp8jax`, CPU device count once a flag is added after it) in a
  fresh interpreter with `env_changes` (None: unset)."""
  env = dict(os.environ)
  for name in ("XLA_FLAGS", xla_env.OPT_OUT, "JAX_NUM_CPU_DEVICES"):
    env.pop(name, None)
  env.update({k: v for k, v in env_changes.items() if v is not None})
  env["PYTHONPATH"] = os.path.abspath(ROOT)
  code = ("import os, fp8jax\n"
          "flags = os.environ.get('XLA_FLAGS', '')\n"
          "os.environ['XLA_FLAGS'] = flags + ' --xla_force_host_platform_device_count=3'\n"
          "import jax\n"
          "print(repr(flags)); print(len(jax.devices('cpu')))\n")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.splitlines()
  return ast.literal_eval(out[-2]), out[-1]


def test_import_sets_the_flag_before_the_backend_starts():
  """After `import fp8jax` XLA_FLAGS holds the flag, and no backend has started yet: a flag
  added after the import still takes effect (3 CPU devices), so XLA reads fp8jax's too."""
  flags, devices = _import_fp8jax({})
  assert flags == BOTH and devices == "3"
  flags, _ = _import_fp8jax({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"})
  assert flags == f"--xla_gpu_enable_triton_gemm=true {CPU_FLAG}"
  flags, _ = _import_fp8jax({xla_env.OPT_OUT: "1"})
  assert flags == ""


def test_applied_line_names_the_flag_and_the_way_out(monkeypatch):
  monkeypatch.setattr(xla_env, "_APPLIED", (FLAG, CPU_FLAG))
  line = xla_env.applied_line()
  assert FLAG in line and CPU_FLAG in line and f"{xla_env.OPT_OUT}=1" in line
  monkeypatch.setattr(xla_env, "_APPLIED", ())
  assert xla_env.applied_line() is None
