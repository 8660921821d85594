"""Metrics a device cannot give are recorded once as absent, with the reason."""
import json

from fp8jax.train import metrics


def test_cpu_has_no_mfu_and_no_memory_and_says_why(monkeypatch):
  absent = metrics.absent_metrics(fp8=True)
  assert absent == {
      "mfu": "no peak FLOP/s known for device kind 'cpu'",
      "mem_gib": "device kind 'cpu' reports no memory statistics",
      "peak_mem_gib": "device kind 'cpu' reports no memory statistics"}
  assert metrics.mfu(1e9, 1e3, True) is None and metrics.memory_in_use() == {}
  assert metrics.describe_absent(absent) == (
      "not logged: mfu (no peak FLOP/s known for device kind 'cpu'); mem_gib, peak_mem_gib "
      "(device kind 'cpu' reports no memory statistics)")
  monkeypatch.setattr(metrics, "peak_flops", lambda kind, fp8: 1e12)  # a known kind
  assert "mfu" not in metrics.absent_metrics(fp8=True) and metrics.mfu(1e9, 1e3, True) > 0


def test_writer_notes_absent_metrics_once(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path))
  texts = []
  assert writer._tb is not None  # tensorboardX is a dependency
  writer._tb.add_text = lambda tag, text, step: texts.append((tag, text, step))
  writer.note_absent(0, {"mfu": "no peak"})
  writer.note_absent(0, {})
  writer.write(1, {"loss": 2.0, "mfu": None})
  writer.close()
  events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
  assert events == [{"step": 0, "event": "metric_absent", "metric": "mfu", "reason": "no peak"}]
  assert texts == [("absent/mfu", "no peak", 0)]
  assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [
      {"step": 1, "loss": 2.0}]
