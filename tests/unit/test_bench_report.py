"""fp8jax.bench's shared pieces: table rendering and JSON (report), timing and the error
measure (timing)."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.bench import report, timing


def _table():
  cols = (report.Column("ms", "ms"), report.Column("n", "count"), report.Column("e", "err", ".1e"))
  rows = [report.Row("base [x]", {"ms": 2.0, "n": 1234, "e": float("nan")}, baseline=True),
          report.Row("fp8", {"ms": 1.0, "n": None, "e": np.float32(0.25)})]
  return report.Table("demo", "a title", cols, rows, ["a note"])


def test_markdown_marks_baselines_and_formats_cells():
  lines = report.markdown(_table()).splitlines()
  assert lines[0] == "a title" and lines[2] == "| variant | ms | count | err |"
  assert lines[4] == "| base [x] (baseline) | 2.00 | 1,234 | nan |"
  assert lines[5] == "| fp8 | 1.00 | - | 2.5e-01 |" and lines[6] == "- a note"
  assert report.cell(True) == "yes" and report.cell("u8") == "u8"


def test_ratio_is_none_without_both_values():
  assert report.ratio(3.0, 2.0) == 1.5
  assert report.ratio(None, 2.0) is None and report.ratio(1.0, None) is None
  assert report.ratio(1.0, 0.0) is None


def test_json_is_strict_with_nan_as_a_string(tmp_path):
  path = tmp_path / "sub" / "out.json"
  report.write_json(str(path), {"tables": [_table().to_dict()]})
  with open(path) as f:
    text = f.read()
  doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not strict JSON"))
  rows = doc["tables"][0]["rows"]
  assert rows[0] == {"label": "base [x]", "baseline": True, "ms": 2.0, "n": 1234, "e": "nan"}
  assert rows[1]["e"] == 0.25 and isinstance(rows[1]["e"], float)
  assert not (tmp_path / "sub" / "out.json.tmp").exists()


def test_show_prints_markdown_off_a_terminal_and_rich_on_one(capsys):
  report.show(_table())
  assert "| fp8 | 1.00 | - | 2.5e-01 |" in capsys.readouterr().out

  class Terminal:
    def __init__(self):
      self.text = []

    def isatty(self):
      return True

    def write(self, s):
      self.text.append(s)

    def flush(self):
      pass
  term = Terminal()
  report.show(_table(), file=term)
  out = "".join(term.text)
  assert "base [x]" in out and "1,234" in out and "| fp8 |" not in out


def test_time_calls_waits_for_warmup_and_timed_calls():
  calls = []

  def fn():
    calls.append(1)
    return jnp.ones(4) * len(calls)
  t = timing.time_calls(fn, iters=3, warmup=2)
  assert len(calls) == 5 and len(t.times) == 3
  assert t.best <= t.median and all(x > 0 for x in t.times)
  assert timing.back_to_back_ms(fn, iters=2, rounds=2) > 0 and len(calls) == 9
  with pytest.raises(ValueError, match="iters=0"):
    timing.time_calls(fn, iters=0)


def test_rel_err_matches_a_float64_reference(key):
  ka, kb = jax.random.split(key)
  ref = jax.random.normal(ka, (64, 48), jnp.float32)
  a = (ref + 1e-3 * jax.random.normal(kb, ref.shape)).astype(jnp.bfloat16)
  a64, r64 = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  want = np.linalg.norm(a64 - r64) / np.linalg.norm(r64)
  assert timing.rel_err(a, ref) == pytest.approx(want, rel=1e-4)
  assert 1e-3 < want < 1e-2  # bf16 rounding dominates: the test data is not trivial
  assert math.isnan(timing.rel_err(a, jnp.zeros_like(ref)))
  assert not timing.rel_err(a.at[0, 0].set(jnp.nan), ref) < 1


def test_custom_calls_and_memory_of_a_compiled_program():
  hlo = ('%a = f32[] custom-call(), custom_call_target="__cublas$lt$matmul$f8"\n'
         '%b = f32[] custom-call(), custom_call_target="__cublas$lt$matmul$f8"\n'
         '%c = f32[] custom-call(), custom_call_target="other"')
  assert timing.custom_calls(hlo) == {timing.FP8_GEMM: 2, "other": 1}
  compiled = jax.jit(lambda x: jnp.sin(x) @ x).lower(jnp.ones((64, 64))).compile()
  mem = timing.memory_gib(compiled)
  assert mem["total"] is None or mem["total"] >= 2 * 64 * 64 * 4 / 2**30  # argument + output
