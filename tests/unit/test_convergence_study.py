"""benchmarks/train/convergence.py's report: relative gaps to the reference at every shared
evaluation, the noise floor from the reference level's other seeds, the verdicts."""
import numpy as np
import pytest

from benchmarks.train import convergence


def test_gaps_noise_and_verdicts_from_random_curves():
  rng = np.random.default_rng()
  steps = [250, 500, 750]
  ref = {s: float(v) for s, v in zip(steps, rng.uniform(1.0, 3.0, 3))}
  seed_gap, fp8_gaps = 0.004, {"O2": 0.002, "O3": -0.007}
  curves = {"O0": ref, "O0-seed1": {s: v * (1 + seed_gap) for s, v in ref.items()}}
  curves.update({l: {s: v * (1 + g) for s, v in ref.items()} for l, g in fp8_gaps.items()})
  curves["O3"][1000] = 1.0  # an evaluation the others lack is left out
  levels = {"O0": "O0", "O0-seed1": "O0", "O2": "O2", "O3": "O3"}
  study = convergence.summarise(curves, levels, {l: None for l in curves})
  assert study["steps"] == steps and study["last_step"] == 750
  assert study["noise"] == pytest.approx(seed_gap) and study["noise_runs"] == ["O0-seed1"]
  for label, gap in fp8_gaps.items():
    assert study["gaps"][label][500] == pytest.approx(gap)
  final = study["final"]
  assert final["O2"]["within_target"] and final["O2"]["within_noise"]
  assert not final["O3"]["within_target"] and not final["O3"]["within_noise"]
  assert final["O0-seed1"]["within_noise"] is None
  text = convergence.markdown(study, tokens_per_step=32768)
  assert "| 750 | 24.6 |" in text and "+0.20" in text and "outside the seed noise" in text


def test_run_labels_are_checked():
  assert convergence.parse_run("O0-seed1=O0,train.seed=1") == ("O0-seed1", "O0",
                                                               ["train.seed=1"])
  with pytest.raises(SystemExit, match="LABEL=LEVEL"):
    convergence.parse_run("O0 seed=O0")
