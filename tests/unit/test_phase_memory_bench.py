"""benchmarks/train/phase_memory.py: its table (units, ratios, phases above the step marked)
and one run on the tiny config (every phase of an O2 run with calibration, from the
Trainer's compiled programs)."""
import json

from benchmarks.train import phase_memory

GiB = 2**30


def test_table_marks_the_phases_above_the_step():
  own = {"train step": 2 * GiB, "evaluation": GiB, "FP8 health probe": int(2.2 * GiB)}
  rows = phase_memory.table(own, state=GiB, estimates={"train step": 3.5 * GiB,
                                                       "FP8 probe": 2.5 * GiB},
                            limit=80 * GiB, margin=0.05)
  assert rows[0].startswith("| phase | own GiB |")
  assert rows[2] == "| train step | 2.00 | 1.00 | 3.00 | 3.50 | 80.0 |"
  assert rows[3] == "| evaluation | 1.00 | 0.50 | 2.00 |  | 80.0 |"
  assert rows[4] == "| FP8 health probe **(above the step)** | 2.20 | 1.10 | 3.20 | 2.50 | 80.0 |"
  small = phase_memory.table({"train step": 2**20}, 0, {}, None, 0.05)
  assert small[0].startswith("| phase | own MiB |") and small[2].endswith("|  |  |")


def test_every_phase_of_a_tiny_o2_run(tmp_path, capsys):
  out = tmp_path / "m.json"
  assert phase_memory.main(["--config", "configs/tiny.yaml", "--set", "train.opt_level=O2",
                            "--set", "fp8.calibrate=always", "--set", "model.n_layers=1",
                            "--set", "data.max_bytes=100000",
                            "--set", f"runtime.run_dir={tmp_path / 'run'}",
                            "--json", str(out)]) == 0
  got = json.loads(out.read_text())["own_bytes"]
  assert set(got) == {"train step", "evaluation", "FP8-BF16 loss gap", "FP8 calibration",
                      "FP8 health probe"}
  assert all(v > 0 for v in got.values())
  assert "| FP8 health probe" in capsys.readouterr().out
