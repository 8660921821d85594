"""Preemption: SIGTERM and the first Ctrl-C ask the loop to stop after the step; a second
Ctrl-C aborts; the previous handlers come back."""
import os
import signal
import time

import pytest

from fp8jax.train.guards import Preemption


def _deliver(signum):
  os.kill(os.getpid(), signum)
  time.sleep(0.05)  # the handler runs in the main thread at the next check


def test_sigterm_asks_to_stop(capfd):
  before = signal.getsignal(signal.SIGTERM)
  with Preemption() as p:
    _deliver(signal.SIGTERM)
    _deliver(signal.SIGTERM)
    assert p.requested and p.signal_name == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is before
  err = capfd.readouterr().err
  assert err.count("received SIGTERM: stopping after the current step") == 1
  assert "Ctrl-C" not in err


def test_first_ctrl_c_asks_to_stop_the_second_aborts(capfd):
  before = signal.getsignal(signal.SIGINT)
  with Preemption() as p:
    _deliver(signal.SIGINT)
    assert p.requested and p.signal_name == "SIGINT"
    assert "received SIGINT: stopping after the current step (saving a checkpoint when " \
        "checkpointing is on); press Ctrl-C again to abort" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
      _deliver(signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before
