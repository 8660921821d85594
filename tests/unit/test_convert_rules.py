"""fp8jax.convert's rules (which GEMMs stay in high precision) and its report, on GEMM lists."""
import io

import pytest
from rich.console import Console

import fp8jax
from fp8jax.convert import ALREADY_FP8, CANDIDATE, ConvertRules, Gemm, _report, block_of, decide


def _gemms(paths, stacked=()):
  return [Gemm(p, "Dense", "bfloat16", stacked, CANDIDATE) for p in paths]


LINEN = [f"Block_{i}/{g}" for i in range(4) for g in ("attn/qkv", "mlp/Dense_0")] + \
    ["embed_proj", "head"]
NNX = [f"layers/{i}/{g}" for i in (0, 1, 2, 10) for g in ("q", "fc")] + ["lm_head"]


def _fp8(kept):
  return sorted(p for p, why in kept.items() if why is None)


def test_default_keeps_the_head_only():
  kept = decide(_gemms(LINEN), ConvertRules())
  assert kept["head"] == "head" and _fp8(kept) == sorted(set(LINEN) - {"head"})
  kept = decide(_gemms(NNX), ConvertRules())
  assert kept["lm_head"] == "head" and len(_fp8(kept)) == 8
  assert _fp8(decide(_gemms(LINEN), ConvertRules(keep_head=False))) == sorted(LINEN)


def test_block_of_finds_the_first_indexed_segment_with_children():
  assert block_of("Block_3/mlp/Dense_0") == ("Block_", 3)
  assert block_of("decoder/layers_12/attn/q") == ("decoder/layers_", 12)
  assert block_of("layers/10/fc") == ("layers/", 10)
  assert block_of("Dense_0") is None and block_of("head") is None


@pytest.mark.parametrize("paths, first, last, blocks", [
    (LINEN, 1, 1, ["Block_0", "Block_3"]),
    (LINEN, 2, 0, ["Block_0", "Block_1"]),
    (NNX, 1, 2, ["layers/0", "layers/2", "layers/10"]),   # by index order, not text order
])
def test_first_and_last_blocks(paths, first, last, blocks):
  kept = decide(_gemms(paths), ConvertRules(keep_first_blocks=first, keep_last_blocks=last))
  held = {p for p, why in kept.items() if why and "block" in why}
  assert held == {p for p in paths if any(p.startswith(b + "/") for b in blocks)}
  assert kept[paths[0]] == f"first {first} block" + ("s" if first > 1 else "")


def test_each_stack_counts_its_own_blocks():
  paths = [f"encoder/layers_{i}/fc" for i in range(3)] + \
      [f"decoder/layers_{i}/fc" for i in range(2)]
  kept = decide(_gemms(paths), ConvertRules(keep_last_blocks=1))
  assert sorted(p for p, why in kept.items() if why) == ["decoder/layers_1/fc",
                                                         "encoder/layers_2/fc"]


def test_keep_by_path_full_match_and_reason():
  kept = decide(_gemms(LINEN), ConvertRules(keep=(r"Block_\d/attn/.*",)))
  assert kept["Block_2/attn/qkv"] == r"keep rule 'Block_\d/attn/.*'"
  assert kept["Block_2/mlp/Dense_0"] is None
  assert decide(_gemms(LINEN), ConvertRules(keep="embed_proj"))["embed_proj"].startswith("keep")


def test_not_convertible_layers_and_o0_are_kept_with_their_reason():
  gemms = _gemms(["a/Dense_0"]) + [Gemm("embed", "Embed.attend", "float32", (), "embedding"),
                                   Gemm("b/Dense_0", "Dense", "bfloat16", (), "custom dot_general")]
  kept = decide(gemms, ConvertRules())
  assert kept == {"a/Dense_0": None, "embed": "embedding", "b/Dense_0": "custom dot_general"}
  gemms.append(Gemm("c/Dense_0", "Dense", "bfloat16", (), ALREADY_FP8))
  kept = decide(gemms, ConvertRules(), fp8=False)
  assert kept["a/Dense_0"] == "level O0" and kept["c/Dense_0"] == ALREADY_FP8
  report = _report("O0", gemms, kept, None)
  assert report.converted == () and report.kept == ("a/Dense_0", "b/Dense_0", "embed")
  assert report["c/Dense_0"].fp8 and report["c/Dense_0"].format == "FP8"


@pytest.mark.parametrize("rules, message", [
    (ConvertRules(keep=("Block_0/attn",)), r"rule 'Block_0/attn' matches no GEMM path"),
    (ConvertRules(keep_first_blocks=5), r"keep_first_blocks=5 exceeds the 4 blocks of stack "
                                        r"'Block_'"),
])
def test_rules_that_match_nothing_are_refused(rules, message):
  with pytest.raises(ValueError, match=message):
    decide(_gemms(LINEN), rules)


def test_position_rules_need_blocks_and_refuse_scanned_layers():
  with pytest.raises(ValueError, match="keep_last_blocks=1 matches no block.*block_pattern"):
    decide(_gemms(["Dense_0", "Dense_1", "head"]), ConvertRules(keep_last_blocks=1))
  with pytest.raises(ValueError, match=r"keep_first_blocks=1 cannot apply: GEMMs \['layers/q'"):
    decide(_gemms(["layers/q"], stacked=(4,)), ConvertRules(keep_first_blocks=1))


@pytest.mark.parametrize("kwargs, message", [
    (dict(keep=("(",)), "not a valid regular expression"),
    (dict(keep=(3,)), "regular expression string"),
    (dict(keep_first_blocks=-1), "keep_first_blocks=-1"),
    (dict(keep_last_blocks=True), "keep_last_blocks=True"),
    (dict(block_pattern=r"_\d+"), "exactly one group"),
    (dict(keep_head="yes"), "keep_head='yes'"),
])
def test_bad_rules_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ConvertRules(**kwargs)


def test_bad_level_and_model_are_refused():
  with pytest.raises(ValueError, match="'O7' is not allowed"):
    fp8jax.convert(object(), "O7")
  with pytest.raises(TypeError, match="flax.linen or flax.nnx Module, got object"):
    fp8jax.convert(object(), "O1")


def test_report_table_as_text_and_rich():
  gemms = _gemms(["Block_0/fc", "head"]) + [Gemm("layers/fc", "Einsum", "bfloat16", (3,),
                                                 CANDIDATE)]
  report = _report("O1", gemms, decide(gemms, ConvertRules()), fp8jax.Recipe())
  assert report.converted == ("Block_0/fc", "layers/fc") and report.kept == ("head",)
  assert report["layers/fc"].layers == 3 and report["layers/fc"].fp8
  assert report["head"].format == "bfloat16" and not report["head"].fp8
  text = str(report)
  assert text.splitlines()[0] == "fp8jax.convert at O1: 4 of 5 GEMMs converted to FP8"
  rows = [line.split() for line in text.splitlines()]
  assert ["head", "Dense", "bfloat16", "1", "head"] in rows
  assert ["layers/fc", "Einsum", "E4M3/E5M2", "3", "-"] in rows
  out = io.StringIO()
  Console(file=out, width=120).print(report)
  assert "layers/fc" in out.getvalue() and "E4M3/E5M2" in out.getvalue()
  with pytest.raises(KeyError, match="no GEMM at path 'nope'"):
    report["nope"]
