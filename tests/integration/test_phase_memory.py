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
from fp8jax.train import batch_loss

TINY = "configs/tiny.yaml"
# A phase may exceed the step by this share of the step's own memory (none does at these
# shapes; the bound leaves room for XLA's buffer assignment on other backends).
MARGIN = 0.05


def _bytes(tree) -> int:
  return int(sum(np.prod(x.shape, dtype=np.int64) * x.dtype.itemsize
                 for x in jax.tree.leaves(tree)))


def _own(compiled, resident) -> int:
  """Bytes a compiled program needs besides `resident` (state arrays among its inputs)."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes - _bytes(resident) + m.output_size_in_bytes
             - m.alias_size_in_bytes + m.temp_size_in_bytes)


def phase_memory(trainer) -> dict[str, int]:
  """{phase: bytes it needs besides the state} of `trainer`'s programs."""
  t = trainer.config.train
  state = trainer.state
  batch = trainer.next_batch(0)
  step = trainer.compiled_step(t.microbatches, calibrated=True)
  out = {"train step": _own(step.jitted.lower(state, *step.place(batch)).compile(), state)}
  e = trainer._eval
  out["evaluation"] = _own(e.jitted.lower(state.params, state.fp8, *e.place(batch)).compile(),
                           (state.params, state.fp8))
  for name, p in (("FP8 probe", trainer._probe), ("calibration", trainer._calibrate)):
    out[name] = _own(p.jitted.lower(state.params, state.fp8, p.place(batch)).compile(),
                     (state.params, state.fp8))
  b = trainer._bf16_loss.eval_step  # the BF16 loss of the watchdog and fp8/loss_gap
  out["divergence check"] = _own(b.jitted.lower(state.params, state.fp8, *b.place(batch))
                                 .compile(), (state.params, state.fp8))
  return out


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
  mem = phase_memory(trainer)
  assert "FP8 probe" in mem and "calibration" in mem
  step = mem.pop("train step")
  for phase, need in mem.items():
    assert need <= step * (1 + MARGIN), (phase, need, step)
  if zero == 0:  # what the bound catches: the 32 evaluation microbatches in one forward
    state, val = trainer.state, np.concatenate([trainer.next_batch(0)] * 16)
    model = trainer.calibration.model
    whole = jax.jit(lambda params, fp8, b: batch_loss(
        model.apply, trainer.state._replace(params=params, fp8=fp8).variables(), b))
    need = _own(whole.lower(state.params, state.fp8, val).compile(), (state.params, state.fp8))
    assert need > 2 * step, (need, step)
