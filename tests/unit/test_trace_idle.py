"""The benchmarks' trace reader: GPU events of a Perfetto trace, and the GPU's busy time and
span (the idle time between kernels that `benchmarks/train/step_profile.py` prints)."""
import gzip
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))
from benchmarks.common import trace  # noqa: E402


def test_busy_and_span_against_a_timeline():
  """Random kernels (overlapping as on several streams, nested, back to back and apart)
  against a unit-resolution timeline of the same integer intervals."""
  rng = np.random.default_rng()
  for _ in range(20):
    n = int(rng.integers(1, 30))
    starts = rng.integers(0, 400, n)
    durs = rng.integers(1, 40, n)
    kernels = [trace.Kernel(f"k{i}", float(d), {}, float(s))
               for i, (s, d) in enumerate(zip(starts, durs))]
    timeline = np.zeros(500, bool)
    for s, d in zip(starts, durs):
      timeline[s:s + d] = True
    busy, span = trace.busy_and_span_us(kernels)
    assert busy == timeline.sum()
    assert span == (starts + durs).max() - starts.min()
  assert trace.busy_and_span_us([]) == (0.0, 0.0)


def test_gpu_kernels_reads_only_the_gpu_events(tmp_path):
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
      {"ph": "X", "pid": 1, "name": "host op", "ts": 0.0, "dur": 100.0},
      {"ph": "X", "pid": 7, "name": "nvjet_gemm", "ts": 10.0, "dur": 4.0, "args": {"hlo_op": "d"}},
      {"ph": "X", "pid": 7, "name": "loop_add_fusion", "ts": 20.0, "dur": 2.5},
  ]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  kernels = trace.gpu_kernels(str(path))
  assert kernels == [trace.Kernel("nvjet_gemm", 4.0, {"hlo_op": "d"}, 10.0),
                     trace.Kernel("loop_add_fusion", 2.5, {}, 20.0)]
  assert trace.busy_and_span_us(kernels) == (6.5, 12.5)
  assert trace.kernel_ms(kernels, calls=1) == 6.5e-3
