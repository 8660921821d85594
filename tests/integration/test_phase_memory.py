"""No phase of a run needs more device memory than its steady train step: the compiled
programs' own memory (``memory_analysis``: temporaries, outputs not aliased to inputs, inputs
that are not the train state the run holds anyway) of the evaluation step, the FP8 probe
(cast health and calibration pass), the divergence watchdog's BF16 loss and the state
initialisation, against the steady step's. The first step runs the steady step's program (the
calibration pass gives it its scales); checkpoints are written and read on the host."""
import jax
import numpy as np
import pytest

from fp8jax.config import load_config
from fp8jax.train.loop import Trainer
from fp8jax.train import batch_loss, memory, oom

TINY = "configs/tiny.yaml"
# A phase may exceed the step by this share of the step's own memory (none does at these
# shapes; the bound leaves room for XLA's buffer assignment on other backends).
MARGIN = 0.05


@pytest.mark.parametrize("zero, stages", [(0, 1), (3, 1), (3, 2)])
def test_no_phase_needs_more_memory_than_the_train_step(tmp_path, zero, stages):
  # eval_batches 32 x 8 sequences: 16x the step's batch of 2 microbatches (of 8: one per device)
  # Pipeline stages: the calibration pass and the cast-health probe run through them.
  sets = ["train.opt_level=O2", "fp8.calibrate=always", "train.batch_size=16",
          "train.microbatches=2", "train.eval_batches=32", "train.fp8_health_every=1",
          "model.n_layers=2", "model.d_model=64", "model.d_ff=256", "data.seq_len=64",
          "model.max_seq_len=64", "checkpoint.checkpoint_every_n_steps=0",
          f"parallel.zero_stage={zero}", f"parallel.pipeline_parallel_size={stages}",
          f"runtime.run_dir={tmp_path}"]
  trainer = Trainer(load_config(TINY, sets), progress=False)
  mem = trainer.phase_memory()
  assert set(mem) == {oom.STEP, oom.EVAL, oom.LOSS_GAP, oom.CALIBRATION, oom.PROBE}, mem
  step = mem.pop(oom.STEP)
  print({phase: f"{need / 2**20:.2f} MiB" for phase, need in mem.items()},
        f"train step {step / 2**20:.2f} MiB")
  for phase, need in mem.items():
    assert need <= step * (1 + MARGIN), (phase, need, step)
  if zero == 0:  # what the bound catches: the 32 evaluation microbatches in one forward
    state, val = trainer.state, np.concatenate([trainer.next_batch(0)] * 16)
    model = trainer.calibration.model
    whole = jax.jit(lambda params, fp8, b: batch_loss(
        model.apply, trainer.state._replace(params=params, fp8=fp8).variables(), b))
    need = memory.program_bytes(whole.lower(state.params, state.fp8, val).compile(),
                                (state.params, state.fp8))
    assert need > 2 * step, (need, step)


def test_cast_health_probe_keeps_no_layer_weight_to_its_backward(tmp_path):
  """The probe's cast-health taps read each GEMM's weight in the forward only (its health is
  kept with the weight's FP8 cast): with 8 scanned layers whose weights outweigh a layer's
  saved activations, a probe whose backward read them again (keeping every layer's decoded
  weight from the forward to the backward) needed 1.12x the step; it needs ~0.83x."""
  sets = ["train.opt_level=O2", "train.fp8_health_every=1", "model.remat=true",
          "model.n_layers=8", "model.d_model=256", "model.d_ff=1024", "model.n_heads=4",
          "train.batch_size=16", "train.microbatches=1", "data.seq_len=128",
          "checkpoint.checkpoint_every_n_steps=0", f"runtime.run_dir={tmp_path}"]
  mem = Trainer(load_config(TINY, sets), progress=False).phase_memory()
  print({phase: f"{need / 2**20:.2f} MiB" for phase, need in mem.items()})
  assert mem[oom.PROBE] <= mem[oom.STEP] * (1 + MARGIN), mem
