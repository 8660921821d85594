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


# (ZeRO stage, pipeline stages, layers, width, sequence length)
@pytest.mark.parametrize("zero, stages, layers, width, seq",
                         [(0, 1, 8, 256, 128), (3, 1, 2, 64, 64), (3, 2, 2, 64, 64)])
def test_no_phase_needs_more_memory_than_the_train_step(tmp_path, zero, stages, layers, width,
                                                        seq):
  # eval_batches 32 x 8 sequences: 16x the step's batch of 2 microbatches (of 8: one per device)
  # Pipeline stages: the calibration pass and the cast-health probe run through them.
  sets = ["train.opt_level=O2", "fp8.calibrate=always", "train.batch_size=16",
          "train.microbatches=2", "train.eval_batches=32", "train.fp8_health_every=1",
          f"model.n_layers={layers}", f"model.d_model={width}", f"model.d_ff={4 * width}",
          f"data.seq_len={seq}", "model.remat=true", f"model.max_seq_len={seq}",
          "checkpoint.checkpoint_every_n_steps=0",
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
  if layers > 2:  # 8 layers whose weights outweigh the activations a layer saves
    # The probe's cast-health taps add numbers, not tensors, to the calibration pass: a probe
    # that kept each layer's weight from its forward to its backward (the taps read the
    # weights there once) needed 62.6 MiB here against the pass's 45.5 (now 45.0).
    assert mem[oom.PROBE] <= mem[oom.CALIBRATION] + MARGIN * step, mem
  if zero == 0:  # what the bound catches: the 32 evaluation microbatches in one forward
    state, val = trainer.state, np.concatenate([trainer.next_batch(0)] * 16)
    model = trainer.calibration.model
    whole = jax.jit(lambda params, fp8, b: batch_loss(
        model.apply, trainer.state._replace(params=params, fp8=fp8).variables(), b))
    need = memory.program_bytes(whole.lower(state.params, state.fp8, val).compile(),
                                (state.params, state.fp8))
    assert need > 2 * step, (need, step)
