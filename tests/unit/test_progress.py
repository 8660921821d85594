"""The progress display without a terminal: one line per log window with the time left."""
import io

import pytest

from fp8jax.train import progress


class _Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_format_eta():
  assert progress.format_eta(None) == "?"
  assert progress.format_eta(0) == "0:00:00"
  assert progress.format_eta(59.6) == "0:01:00"
  assert progress.format_eta(3725) == "1:02:05"


@pytest.mark.parametrize("enabled", [True, False])
def test_lines_per_log_window_without_a_terminal(monkeypatch, enabled):
  clock = _Clock()
  monkeypatch.setattr(progress.time, "monotonic", clock)
  out = io.StringIO()  # not a terminal: lines even when the bar is enabled
  with progress.ProgressBar(10, enabled, stream=out) as bar:
    bar.advance(0)  # the loop's starting position
    for step in range(10):
      clock.now += 30.0 if step == 0 else 2.0  # the first step compiles
      if (step + 1) % 4 == 0 or step == 9:
        bar.advance(0, {"loss": 3.0 - step / 10, "tokens_per_s": 1234.5})
      bar.advance(1)
  assert bar.bar is None
  assert out.getvalue().splitlines() == [
      # rate since the first step (compilation excluded): 3 steps in 6 s; 6 left
      "step 4/10  loss 2.7000  1,234 tok/s  ETA 0:00:12",
      "step 8/10  loss 2.3000  1,234 tok/s  ETA 0:00:04",
      "step 10/10  loss 2.1000  1,234 tok/s  ETA 0:00:00",
  ]


def test_first_window_of_one_step_has_no_rate_yet():
  out = io.StringIO()
  with progress.ProgressBar(3, False, stream=out) as bar:
    bar.advance(0)
    bar.advance(0, {"loss": 5.0, "tokens_per_s": 10.0})
    bar.advance(1)
  assert out.getvalue() == "step 1/3  loss 5.0000  10 tok/s  ETA ?\n"
