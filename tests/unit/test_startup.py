"""Where a run's first-step wait goes: phases without their compile work, compile totals from
every thread, the printed line."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.train import compiles, startup
from fp8jax.train.startup import StartupClock


def _big(a):
  for i in range(150):  # a program that takes a while to trace and compile
    a = jnp.tanh(a @ a.T * (1.0 + i)) + jnp.roll(a, i, axis=0)
  return a


def test_a_phase_counts_its_own_time_not_the_compiles_inside_it():
  clock = StartupClock()
  x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  t = time.perf_counter()
  with clock.phase(startup.DATA):
    time.sleep(0.2)
    jax.jit(_big).lower(x).compile()
  with clock.phase(startup.DATA):  # spans of one name add up
    time.sleep(0.1)
  wall = time.perf_counter() - t
  s = clock.stop()
  work = s["tracing_s"] + s["compiling_s"]
  assert s["programs"] >= 1 and s["compiling_s"] > 0 and work > 0.1, s
  assert 0.3 <= s["data_s"] <= wall - 0.9 * work, s  # the compile is not the phase's
  assert s["total_s"] >= s["data_s"] + s["compiling_s"]
  with clock.phase(startup.STEP):  # after stop: not timed, the summary stays
    time.sleep(0.01)
  assert clock.stop() is s and "step_s" not in s


def test_compile_totals_count_other_threads():
  before = compiles.totals()
  x = np.arange(8, dtype=np.float32)
  n = compiles.compile_ahead([lambda: jax.jit(lambda a: jnp.cumsum(a) * 3).lower(x)])
  d = compiles.totals() - before
  assert n == 1 and d.compiles >= 1 and d.compile_s > 0


def test_compile_ahead_skips_a_program_that_fails_to_trace():
  def bad():
    raise ValueError("no such shape")
  x = np.ones((4,), np.float32)
  f = jax.jit(lambda a: a * 2)
  with compiles.CompileLog() as log:
    assert compiles.compile_ahead([bad, lambda: f.lower(x)]) == 1
    f(x)  # runs what was compiled ahead
  assert [c.thread.startswith(compiles.COMPILE_THREAD) for c in log.of("<lambda>")] == [True]


def test_the_line_puts_the_largest_part_first_and_leaves_out_crumbs():
  line = startup.describe({"total_s": 20.0, "tracing_s": 8.2, "compiling_s": 3.6,
                           "programs": 3, "cache_hits": 3, "data_s": 4.7, "state_s": 0.01,
                           "bf16_loss_s": 0.5, "other_s": 1.0})
  assert line == ("tracing 8.2 s, data 4.7 s, compiling 3.6 s (3 of 3 programs from the "
                  "cache), other 1.0 s, bf16 loss 0.5 s")
