"""Training: state, step (one builder of small pieces), metrics, guards, the Trainer loop."""
from fp8jax.train.model import UserModel
from fp8jax.train.state import TrainState, init_state, load_params
from fp8jax.train.loss import batch_loss, cross_entropy
from fp8jax.train.step import (GroupLoop, PipelineLoop, TrainStep, UniformLoop, build_step,
                               eval_loss_fn, make_train_step)

__all__ = ["GroupLoop", "PipelineLoop", "TrainState", "TrainStep", "UniformLoop", "UserModel",
           "batch_loss", "build_step", "cross_entropy", "eval_loss_fn", "init_state",
           "load_params", "make_train_step"]
