"""benchmarks/train/step_compile.py: the fusion count of optimized HLO text and one measured
variant."""
import os

from benchmarks.train import step_compile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HLO = """
%fused_a (p: f32[4,8]) -> f32[4,8] {
  ROOT %m = f32[4,8]{1,0} multiply(%p, %p)
}
ENTRY %main (x: f32[4,8], s: f32[]) -> (f32[4,8], f32[16]) {
  %big = f32[4,8]{1,0} fusion(f32[4,8]{1,0} %x), kind=kLoop, calls=%fused_a
  %pair = (f32[], f32[16]{0}) fusion(f32[] %s), kind=kLoop, calls=%fused_b
  ROOT %t = (f32[4,8]{1,0}, f32[16]{0}) tuple(%big, %x)
}
"""


def test_fusions_are_counted_by_their_largest_output():
  shapes = step_compile._FUSION.findall(HLO)
  assert [step_compile._largest_output(s) for s in shapes] == [32, 16]


def test_one_variant_measures_the_calibrated_step():
  got = step_compile.measure(os.path.join(ROOT, "configs", "tiny.yaml"), "O1", [])
  assert got["compile_s"] > 0 and got["lower_s"] > 0
  assert got["fusions"] > got["small_fusions"] > 0  # FP8 scale updates are small fusions
