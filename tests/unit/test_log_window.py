"""The log window's clock (tokens/s): the evaluation stays out of its seconds (the device's
work on the steps before it stays in), and so do the compiles of programs at their first use
(the health probe, the guards' BF16 loss), whose running time counts."""
import pytest

from fp8jax.train.loop import _LogWindow


def test_paused_time_is_left_out_and_the_wait_for_the_steps_counts():
  now = [100.0]
  window = _LogWindow(clock=lambda: now[0])
  now[0] += 2.0  # steps dispatched
  waited = []

  def wait():  # the device finishes the window's steps: training time
    waited.append(now[0])
    now[0] += 0.5

  with window.paused(wait):
    now[0] += 30.0  # a probe's compile and run
  now[0] += 1.0  # more steps
  assert waited == [102.0]
  assert window.seconds() == pytest.approx(3.5)
  with pytest.raises(RuntimeError), window.paused(lambda: None):
    now[0] += 4.0
    raise RuntimeError("out of memory")
  assert window.seconds() == pytest.approx(3.5)  # left out when the block raises too
  window.reset()
  now[0] += 0.25
  assert window.seconds() == pytest.approx(0.25)


def test_a_first_use_compile_is_left_out_and_the_run_counts():
  from fp8jax.train.compiles import Totals
  now, work = [0.0], [Totals()]
  window = _LogWindow(clock=lambda: now[0])
  now[0] += 2.0
  with window.without_compiles(totals=lambda: work[0]):
    now[0] += 9.0  # tracing 1 s, lowering 0.5 s, compiling 7 s, then 0.5 s of running
    work[0] = Totals(trace_s=1.0, lower_s=0.5, compile_s=7.0, compiles=1)
  assert window.seconds() == pytest.approx(2.5)
  with window.without_compiles(totals=lambda: work[0]):  # compiled: all of it counts
    now[0] += 0.5
  assert window.seconds() == pytest.approx(3.0)
