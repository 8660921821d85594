"""Training: state, step (microbatches, clipping, optimizer, FP8 state), metrics, loop."""
from fp8jax.train.state import TrainState
from fp8jax.train.step import cross_entropy, make_eval_step, make_train_step

__all__ = ["TrainState", "cross_entropy", "make_eval_step", "make_train_step"]
