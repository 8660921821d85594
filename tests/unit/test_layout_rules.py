"""The layout rules (fp8jax.parallel.layout_rules) against JAX's own placement checks: on
thousands of random layouts a layout is accepted exactly when every array the run places
splits evenly over its mesh axes (JAX's ``shard_shape`` on an abstract mesh of the layout's
sizes) and it is none of the refused combinations; refusals are one line naming the numbers;
what the config refuses without the device count stays refused with any count."""
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from fp8jax.config import config_from_dict
from fp8jax.parallel import layout_rules
from fp8jax.parallel.layout_rules import Layout
from fp8jax.train import build

SEQ = 16  # tokens per sequence of the oracle's batch arrays (any length: never split)


def _seed() -> int:
  seed = int(os.environ.get("FP8JAX_TEST_SEED", np.random.SeedSequence().entropy % (1 << 31)))
  print(f"layout rules: seed {seed} (FP8JAX_TEST_SEED={seed} replays it)")
  return seed


def _random_layout(rng) -> Layout:
  devices = int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16]))
  data, fsdp = [(-1, 1), (-1, 1), (-1, 2), (2, -1), (int(rng.integers(1, 5)), 1),
                (1, int(rng.integers(1, 5))), (2, 2)][rng.integers(7)]
  n_heads, d_ff = int(rng.choice([3, 4, 8])), int(rng.choice([48, 64, 96]))
  microbatches = int(rng.choice([1, 2, 3, 4, 6, 8]))
  return Layout(
      devices=devices, data=data, fsdp=fsdp, tensor=int(rng.choice([1, 1, 1, 2, 3, 4])),
      pipe=int(rng.choice([1, 1, 1, 2, 3, 4])),
      batch_size=microbatches * int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24]))
      + int(rng.random() < 0.1), microbatches=microbatches, zero_stage=int(rng.integers(4)),
      grad_comm=str(rng.choice(["native", "native", "fp8"])), balanced=bool(rng.random() < 0.2),
      n_layers=int(rng.choice([1, 2, 3, 4, 6, 8, 12])),
      tensor_splits=(("model.n_heads", n_heads), ("model.d_ff", d_ff)))


def _mesh(layout: Layout):
  """The layout's abstract mesh (pipe, data, fsdp, tensor), or None when no sizes give
  exactly its devices (written out here, not with fp8jax.parallel.mesh_shape)."""
  sizes = {"data": layout.data, "fsdp": layout.fsdp}
  fixed = layout.pipe * layout.tensor * np.prod([v for v in sizes.values() if v != -1])
  for name, value in sizes.items():
    if value == -1:
      if layout.devices % fixed:
        return None
      sizes[name] = layout.devices // fixed
  if layout.pipe * layout.tensor * sizes["data"] * sizes["fsdp"] != layout.devices:
    return None
  return AbstractMesh((layout.pipe, sizes["data"], sizes["fsdp"], layout.tensor),
                      ("pipe", "data", "fsdp", "tensor"))


def _splits(mesh, shape, spec) -> bool:
  """Whether JAX can place an array of `shape` with `spec` on `mesh` (equal shards)."""
  try:
    NamedSharding(mesh, spec).shard_shape(shape)
  except ValueError:  # jax's IndivisibleError
    return False
  return True


def _oracle(layout: Layout) -> bool:
  """Whether a run of `layout` can go: its arrays place on its mesh and it is not a refused
  combination (module docstring of fp8jax.parallel.layout_rules)."""
  b, k, pipe = layout.batch_size, layout.microbatches, layout.pipe
  mesh = _mesh(layout)
  if b % k or mesh is None or (pipe > 1 and k < pipe):
    return False
  ranks = mesh.shape["data"] * mesh.shape["fsdp"]
  batch_axes = P(("data", "fsdp"))
  placed = [((layout.n_layers, 8), P("pipe"))]  # stacked layers over the stages
  placed += [((value,), P("tensor")) for _, value in layout.tensor_splits]
  if not layout.balanced:  # step batch, evaluation batch (a microbatch), pipeline parts
    placed += [((b, SEQ + 1), batch_axes), ((b // k, SEQ + 1), batch_axes),
               ((k, b // k, SEQ + 1), P(None, ("data", "fsdp")))]
  if not all(_splits(mesh, shape, spec) for shape, spec in placed):
    return False
  if layout.grad_comm == "fp8" and ranks < 2:
    return False
  return not (pipe > 1 and layout.tensor > 1 and layout.zero_stage >= 2 and ranks >= 2)


def test_rules_accept_exactly_what_places():
  """4000 random layouts (1-16 devices): check() is None exactly when the oracle accepts;
  every refusal is one line starting with a config key and naming a number; a refusal
  without the device count is a refusal with it."""
  rng = np.random.default_rng(_seed())
  counts = {"accepted": 0, "refused": 0, "refused_early": 0}
  for _ in range(4000):
    layout = _random_layout(rng)
    message = layout_rules.check(layout)
    assert (message is None) == _oracle(layout), (layout, message)
    early = layout_rules.check(layout._replace(devices=None))
    if early is not None:
      assert message is not None, (layout, early)
      counts["refused_early"] += 1
    if message is None:
      counts["accepted"] += 1
      continue
    counts["refused"] += 1
    assert "\n" not in message and len(message) < 500, message
    assert re.match(r"(train|parallel|model)[.:]", message), message
    assert re.search(r"=-?\d", message), message
  print(counts)
  assert min(counts.values()) > 200  # the sample covers both outcomes


@pytest.mark.parametrize("layout, words", [
    # a microbatch of 2 sequences over 4 data ranks (8 devices, 2 stages): the O1 deadlock
    (Layout(8, pipe=2, batch_size=8, microbatches=4, n_layers=4),
     "train.batch_size=8 / train.microbatches=4 = 2 sequences per microbatch do not split over "
     "the 4 data-parallel ranks (8 devices: pipe=2 x data=4 x fsdp=1 x tensor=1); every rank "
     "runs an equal share of each microbatch: use a microbatch size that is a multiple of 4 "
     "(e.g. train.batch_size=16) or fewer data-parallel ranks"),
    (Layout(8, zero_stage=3, batch_size=6), "6 sequences per microbatch do not split over "
     "the 8 data-parallel ranks"),
    (Layout(8, pipe=2, tensor=2, zero_stage=3, batch_size=16, microbatches=2),
     "parallel.zero_stage=3 with parallel.pipeline_parallel_size=2 and "
     "parallel.tensor_parallel_size=2 over 2 data-parallel ranks"),
    (Layout(6, pipe=4, batch_size=8, microbatches=4),
     "parallel: 6 devices do not split into pipe=4 pipeline stages"),
    (Layout(8, data=1, grad_comm="fp8", tensor=8, batch_size=8),
     "parallel.grad_comm='fp8' needs at least 2 data-parallel ranks; this run has 1"),
    (Layout(8, pipe=2, batch_size=8, microbatches=1, n_layers=3),
     "parallel.pipeline_parallel_size=2 does not divide model.n_layers=3"),
    (Layout(None, tensor=3, tensor_splits=(("model.n_heads", 4), ("model.d_ff", 64))),
     "model.n_heads=4 does not split over parallel.tensor_parallel_size=3"),
])
def test_refusal_messages(layout, words):
  assert words in layout_rules.check(layout)


def test_balanced_groups_take_whole_microbatches():
  """With device_map (balanced counts) a microbatch need not split over the groups."""
  layout = Layout(8, batch_size=6, microbatches=3)
  assert "2 sequences per microbatch" in layout_rules.check(layout)
  assert layout_rules.check(layout._replace(balanced=True)) is None


def test_config_checks_what_it_knows():
  """The config refuses a layout its own numbers rule out (explicit data sizes), leaves the
  device-dependent rules to the run (build.check_layout), and counts a run that asks for no
  parallelism as one device."""
  with pytest.raises(ValueError, match=r"6 sequences per microbatch do not split over the 4 "
                     r"data-parallel ranks \(parallel.data_parallel_size=4 x "):
    config_from_dict({"train": {"batch_size": 6}, "parallel": {"data_parallel_size": 4}})
  zero3 = config_from_dict({"train": {"batch_size": 6}, "parallel": {"zero_stage": 3}})
  assert build.run_device_count(zero3, 8) == 8
  with pytest.raises(ValueError, match=r"over the 8 data-parallel ranks \(8 devices: "):
    zero3.check_layout(8)
  alone = config_from_dict({"train": {"batch_size": 6}})
  assert build.run_device_count(alone, 8) == 1
  alone.check_layout(1)
  assert jax.device_count() == 8
  with pytest.raises(ValueError, match=r"6 sequences per microbatch do not split over the 8"):
    build.check_layout(zero3)
