"""Training: state, step (one builder of small pieces), metrics, guards, the Trainer loop."""
from fp8jax.train.model import UserModel
from fp8jax.train.state import TrainState, init_state, load_params
from fp8jax.train.step import (GroupLoop, PipelineLoop, TrainStep, UniformLoop, build_step,
                               cross_entropy, make_eval_step, make_train_step, next_token_loss)

__all__ = ["GroupLoop", "PipelineLoop", "TrainState", "TrainStep", "UniformLoop", "UserModel",
           "build_step", "cross_entropy", "init_state", "load_params", "make_eval_step",
           "make_train_step", "next_token_loss"]
