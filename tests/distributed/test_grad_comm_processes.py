"""FP8 gradient communication across processes: `fp8jax launch -n 2 -- fp8jax train` with
parallel.grad_comm=fp8 and automatic comm scaling (2 jax.distributed processes on 127.0.0.1,
one CPU device each, gloo collectives) agrees with one process on 2 CPU devices."""
import json
import os
import time
import sys

import orbax.checkpoint as ocp
import pytest

import ft_util

STEPS = 4
PARALLEL = {"grad_comm": "fp8", "grad_comm_scaling": "auto", "grad_comm_growth_interval": 2}


def _records(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if '"loss"' in line]


def _saved_comm(run_dir, step):
  """{field: shape} of the comm state in checkpoint `step` (its metadata)."""
  md = ocp.StandardCheckpointer().metadata(os.path.join(run_dir, "checkpoints", str(step),
                                                        "state"))
  tree = getattr(getattr(md, "item_metadata", md), "tree", md)
  return {k: tuple(v.shape) for k, v in tree["comm"].items()}


@pytest.mark.slow
def test_two_process_fp8_grad_comm_matches_one_process_on_two_devices(tmp_path):
  kw = dict(train={"steps": STEPS, "opt_level": "O1"}, parallel=PARALLEL,
            checkpoint={"checkpoint_every_n_steps": STEPS, "auto_resume": False},
            runtime={"heartbeat_interval": 120.0})
  one = ft_util.tiny_config(tmp_path / "one.yaml", tmp_path / "one", **kw)
  two = ft_util.tiny_config(tmp_path / "two.yaml", tmp_path / "two", **kw)
  t0 = time.monotonic()
  single = ft_util.run(ft_util.train_cmd(one), 240, env=ft_util.env(JAX_NUM_CPU_DEVICES=2))
  assert single.returncode == 0, single.stderr[-3000:]
  t1 = time.monotonic()
  multi = ft_util.run([sys.executable, "-m", "fp8jax.cli", "launch", "-n", "2", "--"]
                      + ft_util.train_cmd(two), 240, env=ft_util.env())
  assert multi.returncode == 0, multi.stderr[-3000:]
  print(f"1 process: {t1 - t0:.1f} s, 2 processes: {time.monotonic() - t1:.1f} s")
  assert multi.stdout.count("process 0 of 2") == 1 and multi.stdout.count("process 1 of 2") == 1
  assert "2 x cpu" in single.stdout
  ref, got = _records(tmp_path / "one"), _records(tmp_path / "two")
  assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
  for a, b in zip(got, ref):
    assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"])  # same batches and program
    # the replicated comm scaling state evolves the same way
    assert a["comm/pre_scale_min"] == b["comm/pre_scale_min"]
    assert abs(a["comm/saturated_max"] - b["comm/saturated_max"]) <= 1e-3
  assert ref[0]["comm/saturated_max"] == 0.0  # step 1: current scaling
  # and the 2-process run's checkpoint holds it (one entry per parameter leaf)
  shapes = _saved_comm(tmp_path / "two", STEPS)
  assert set(shapes) == {"amax", "pre_scale", "clean_steps", "saturated"}
  assert len(set(shapes.values())) == 1 and shapes["amax"][0] > 1
