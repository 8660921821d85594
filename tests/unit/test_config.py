"""Config: shipped files load, base.yaml lists every default, sections derived from the
objects they configure, level rules asked of the OptLevel, YAML round trip, overrides, and one
test per kind of mistake."""
import dataclasses
import glob
import os
import re

import pytest
import yaml

from fp8jax import LEVELS, Recipe
from fp8jax.config import (NOT_BUILT_YET, BatchRamp, Config, Fp8Section, ModelSection,
                           config_from_dict, config_to_dict, load_config, save_config)
from fp8jax.models.gpt import ModelConfig
from fp8jax.recipe import format_name
from fp8jax.train import build

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
SHIPPED = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
TINY = os.path.join(CONFIGS, "tiny.yaml")
BASE = os.path.join(CONFIGS, "base.yaml")


def _error(overrides, path=None) -> str:
  """The ValueError message of loading `path` (default: no file) with `overrides`."""
  with pytest.raises(ValueError) as e:
    load_config(path, overrides)
  return str(e.value)


def _write(tmp_path, text: str) -> str:
  path = tmp_path / "cfg.yaml"
  path.write_text(text)
  return str(path)


def test_shipped_configs_are_there():
  names = {os.path.basename(p) for p in SHIPPED}
  assert {"base.yaml", "tiny.yaml", "gpt_125m.yaml", "gpt_1_3b.yaml", "gpt_7b.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_loads(path):
  cfg = load_config(path)
  stem = os.path.splitext(os.path.basename(path))[0]
  if path != BASE:  # base.yaml spells out runtime.name's default too
    assert cfg.runtime.name == stem and cfg.runtime.run_path == f"runs/{stem}"
  assert cfg.data.seq_len <= cfg.model.max_seq_len


# Configs whose token budget no built-in corpus holds (the 7B batch-ramp recipe reads tens of
# billions of tokens; its comment says to point data.source at a .bin).
BEYOND_BUILTIN = {"gpt_7b_ramp.yaml"}


@pytest.mark.parametrize("path", [p for p in SHIPPED if os.path.basename(p) not in
                                  ("base.yaml", "tiny.yaml")], ids=os.path.basename)
def test_gpu_configs_read_site_packages_within_one_epoch(path):
  """Every shipped GPU config trains on the installed packages' source, and its cap lets it
  stay within one epoch: train.steps' tokens (bytes: byte-level) fit in the training split of
  data.max_bytes; docs/data.md says how much must be installed for that."""
  cfg = load_config(path)
  assert cfg.data.source == "site-packages" and cfg.data.byte_level
  tokens = cfg.tokens_seen(cfg.train.steps)
  train_bytes = cfg.data.max_bytes * (1 - cfg.data.val_fraction)
  if os.path.basename(path) in BEYOND_BUILTIN:
    assert tokens > 50 * train_bytes
    with open(path) as f:
      assert "set\n# data.source to a pre-tokenized .bin" in f.read()
  else:
    assert tokens <= train_bytes, (tokens, train_bytes)
    with open(os.path.join(CONFIGS, "..", "docs", "data.md")) as f:  # what must be installed
      readme = " ".join(f.read().split())
    stem = os.path.splitext(os.path.basename(path))[0]
    assert f"{tokens / 1e6:.1f} M" in readme and f"`{stem}" in readme


def test_shipped_shapes():
  tiny, m125, m1b, m7b = (load_config(os.path.join(CONFIGS, n)) for n in
                          ("tiny.yaml", "gpt_125m.yaml", "gpt_1_3b.yaml", "gpt_7b.yaml"))
  assert tiny.data.source == "stdlib" and tiny.train.opt_level == "O1"
  assert (m125.model.n_layers, m125.model.d_model, m125.data.seq_len) == (12, 768, 1024)
  assert (m1b.model.n_layers, m1b.model.d_model) == (24, 2048)
  assert (m7b.model.n_layers, m7b.model.d_model, m7b.model.d_ff, m7b.model.mlp) == \
      (32, 4096, 11008, "swiglu")


def test_defaults():
  cfg = load_config(None)
  assert cfg == Config()
  t = cfg.train
  assert (t.opt_level, t.learning_rate, t.gradient_clipping, t.min_lr_ratio, t.weight_decay) == \
      ("O1", 1e-4, 1.0, 0.1, 0.1)
  assert (t.b1, t.b2, t.eps, t.microbatches, t.batch_ramp) == (0.9, 0.95, 1e-8, 1, None)
  assert (cfg.data.val_fraction, cfg.data.max_bytes) == (0.05, 32 * 2**20)
  # Training casts with the fused cast+transpose kernel where it runs (the library's Recipe
  # leaves it off); calibration is the Trainer's (fp8.calibrate), never the config's recipe.
  assert cfg.fp8.recipe() == Recipe(fused_cast_transpose=True)
  assert (cfg.fp8.calibrate, t.fused_optimizer) == ("auto", "auto")
  assert cfg.fp8.cast_weights_once is True


def _same(a, b) -> bool:
  """a == b with the same types all the way down (1 is not 1.0, True is not 1)."""
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  return type(a) is type(b) and a == b


def _differences(got, want, path=""):
  """Key paths where nested dicts `got` and `want` differ (missing, extra, value or type)."""
  if not (isinstance(got, dict) and isinstance(want, dict)):
    return [] if _same(got, want) else [f"{path}: {got!r} != default {want!r}"]
  out = [f"{path}.{k}: extra key" for k in got.keys() - want.keys()]
  out += [f"{path}.{k}: missing" for k in want.keys() - got.keys()]
  for k in got.keys() & want.keys():
    out += _differences(got[k], want[k], f"{path}.{k}" if path else k)
  return out


def test_base_yaml_is_every_default():
  """configs/base.yaml lists every key of every section, each with its default value (and
  type), in the dataclasses' order, and nothing else."""
  with open(BASE, encoding="utf-8") as f:
    data = yaml.safe_load(f)
  defaults = config_to_dict(Config())
  assert not _differences(data, defaults), _differences(data, defaults)
  assert list(data) == list(defaults)
  assert all(list(data[s]) == list(defaults[s]) for s in defaults)
  assert load_config(BASE) == Config()


def test_base_yaml_says_what_every_key_does():
  with open(BASE, encoding="utf-8") as f:
    lines = f.read().splitlines()
  keys = [line for line in lines if re.match(r"\s+\w+:", line)]
  assert len(keys) == sum(len(s) for s in config_to_dict(Config()).values())
  for line in keys:
    assert re.search(r"#\s*\S{2,}", line), f"no comment: {line!r}"
  assert all(len(line) <= 100 for line in lines)


def test_model_section_is_model_config():
  """One key per ModelConfig field, with its type and default except the config's own
  defaults (the tiny CPU run); the values are checked by ModelConfig itself."""
  own_defaults = {"d_model": 128, "d_ff": 512, "max_seq_len": 128}
  section = {f.name: f for f in dataclasses.fields(ModelSection)}
  assert list(section)[:len(dataclasses.fields(ModelConfig))] == [
      f.name for f in dataclasses.fields(ModelConfig)]
  for f in dataclasses.fields(ModelConfig):
    assert section[f.name].default == own_defaults.get(f.name, f.default), f.name
  assert ModelSection().model_config() == ModelConfig(**own_defaults)
  gpt_keys = lambda section: {f.name: getattr(section, f.name)
                              for f in dataclasses.fields(ModelConfig)}
  assert ModelConfig(**gpt_keys(ModelSection())) == ModelSection().model_config()
  cfg = load_config(TINY, ["model.mlp=swiglu", "model.remat=true"])
  assert cfg.model.model_config() == ModelConfig(**gpt_keys(cfg.model))


def test_fp8_section_is_recipe():
  """Every Recipe field but `calibrated` (set by the Trainer) with Recipe's default (formats
  by name; fused_cast_transpose on in training), plus the Trainer's own `calibrate` and
  `cast_weights_once`."""
  recipe_fields = [f for f in dataclasses.fields(Recipe) if f.name != "calibrated"]
  assert [f.name for f in dataclasses.fields(Fp8Section)] == [f.name for f in recipe_fields] + [
      "calibrate", "cast_weights_once"]
  section = Fp8Section()
  for f in recipe_fields:
    want = {"fwd_format": format_name(Recipe.fwd_format),
            "bwd_format": format_name(Recipe.bwd_format),
            "fused_cast_transpose": True}.get(f.name, f.default)
    assert getattr(section, f.name) == want, f.name
  assert (section.fwd_format, section.bwd_format) == ("e4m3", "e5m2")
  assert Fp8Section(bwd_format="e4m3", scaling="current").recipe() == Recipe(
      bwd_format="e4m3", scaling="current", fused_cast_transpose=True)


@pytest.mark.parametrize("item,expected", [
    ("model.n_layers=0", "model.n_layers=0 is not allowed; use an integer >= 1"),
    ("model.rope_theta=1", "model.rope_theta=1.0 is not allowed; use a number > 1"),
    ("model.attention_impl=flash", "model.attention_impl='flash' is not allowed; use one of "
                                   "['auto', 'xla', 'cudnn']"),
    ("model.dtype=float16", "model.dtype='float16' is not allowed; use one of ['bfloat16', "),
    ("fp8.fwd_format=e5m2", "fp8.fwd_format='e5m2' is not allowed; use one of 'e4m3'"),
    ("fp8.amax_compute_algo=mean", "fp8.amax_compute_algo='mean' is not allowed; use one of "),
])
def test_derived_sections_word_errors_as_key_paths(item, expected):
  msg = _error([item])
  assert expected in msg and "ModelConfig" not in msg and "Recipe." not in msg


def test_round_trip(tmp_path):
  cfg = load_config(TINY, ["train.microbatches=4", "train.learning_rate=3e-4",
                           "train.batch_ramp={start_tokens: 512, end_tokens: 2048, ramp_steps: 10}",
                           "fp8.scaling=current", "model.remat=true", "runtime.name=exp-1"])
  path = tmp_path / "out" / "saved.yaml"
  save_config(cfg, path)
  again = load_config(path)
  assert again == cfg
  assert config_to_dict(again) == config_to_dict(cfg)
  assert config_from_dict(config_to_dict(cfg)) == cfg
  save_config(again, tmp_path / "again.yaml")
  assert (tmp_path / "again.yaml").read_text() == path.read_text()


def test_overrides_parse_types():
  cfg = load_config(TINY, ["train.learning_rate=3e-4", "train.steps=70", "model.remat=true",
                           "data.source=/tmp/corpus/*.txt", "train.gradient_clipping=0",
                           "runtime.run_dir=out/{name}/x"])
  assert cfg.train.learning_rate == 3e-4 and isinstance(cfg.train.learning_rate, float)
  assert cfg.train.steps == 70 and cfg.model.remat is True
  assert cfg.data.source == "/tmp/corpus/*.txt"
  assert cfg.train.gradient_clipping == 0.0 and isinstance(cfg.train.gradient_clipping, float)
  assert cfg.runtime.run_path == "out/tiny/x"


def test_override_unknown_key_suggests():
  msg = _error(["train.lerning_rate=0.01"])
  assert "train.lerning_rate=0.01" in msg and "did you mean 'learning_rate'" in msg


@pytest.mark.parametrize("item", ["train.steps", "steps=3", "train..steps=3"])
def test_malformed_override(item):
  msg = _error([item])
  assert repr(item) in msg and "section.key=value" in msg


def test_unknown_key_in_file_suggests(tmp_path):
  msg = _error([], _write(tmp_path, "model:\n  n_head: 8\n"))
  assert "cfg.yaml" in msg and "model.n_head=8" in msg and "did you mean 'n_heads'" in msg
  msg = _error([], _write(tmp_path, "trian:\n  steps: 3\n"))
  assert "trian=" in msg and "did you mean 'train'" in msg


def test_duplicate_key_and_bad_top_level(tmp_path):
  assert "'steps' appears twice" in _error([], _write(tmp_path, "train:\n  steps: 1\n  steps: 2\n"))
  assert "top level" in _error([], _write(tmp_path, "- train\n"))
  msg = _error([], _write(tmp_path, "train: 3\n"))
  assert "train=3 has type int; expected a mapping with keys" in msg


@pytest.mark.parametrize("item,expected", [
    ("train.steps='100'", "train.steps='100' has type str; expected an integer"),
    ("train.steps=1.5", "train.steps=1.5 has type float; expected an integer"),
    ("train.microbatches=true", "train.microbatches=True has type bool; expected an integer"),
    ("model.remat=1", "model.remat=1 has type int; expected true or false"),
    ("train.learning_rate=fast", "train.learning_rate='fast' has type str; expected a number"),
    ("train.learning_rate=.nan", "train.learning_rate=nan is not allowed; use a finite number"),
    ("data.source=3", "data.source=3 has type int; expected a string"),
    ("fp8.amax_history_len=16.0", "fp8.amax_history_len=16.0 has type float; expected an integer"),
    ("train.batch_ramp=4", "train.batch_ramp=4 has type int; expected a mapping with keys"),
])
def test_wrong_type(item, expected):
  assert expected in _error([item])


def test_int_accepted_for_float():
  cfg = load_config(None, ["train.learning_rate=1"])
  assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)


@pytest.mark.parametrize("item,expected", [
    ("data.val_fraction=1.0", "data.val_fraction=1.0 is not allowed; use a number in (0, 1)"),
    ("data.val_fraction=0", "data.val_fraction=0.0 is not allowed; use a number in (0, 1)"),
    ("train.microbatches=0", "train.microbatches=0 is not allowed; use a value >= 1"),
    ("train.learning_rate=-1e-3", "train.learning_rate=-0.001 is not allowed; use a value > 0"),
    ("train.b2=1.0", "train.b2=1.0 is not allowed; use a number in [0, 1)"),
    ("train.opt_level=O4", "train.opt_level='O4' is not allowed; use one of ['O0', 'O1', 'O2'"),
    ("model.mlp=relu", "model.mlp='relu' is not allowed; use one of ['gelu', 'swiglu']"),
    ("parallel.zero_stage=4", "parallel.zero_stage=4 is not allowed; use one of [0, 1, 2, 3]"),
    ("runtime.name=a/b", "runtime.name='a/b' is not allowed; use a name of letters"),
    ("runtime.run_dir=runs/{user}", "runtime.run_dir='runs/{user}' is not allowed"),
    ("fp8.margin=-1", "fp8.margin=-1 is not allowed; use a finite number >= 0"),  # from Recipe
    ("fp8.scaling=dynamic", "fp8.scaling='dynamic' is not allowed; use one of ['delayed', "),
])
def test_out_of_range(item, expected):
  assert expected in _error([item])


@pytest.mark.parametrize("items,expected", [
    (["train.microbatches=3"], "train.microbatches=3 does not divide train.batch_size=16"),
    (["model.d_model=130"], "model.d_model=130 is not divisible by model.n_heads=4"),
    (["model.d_model=132", "model.n_heads=4"], "model: head dim d_model/n_heads=33 is odd; "
     "RoPE needs an even head dim (model.d_model=132, model.n_heads=4)"),
    (["model.fuse_gelu_into_fp8_cast=true", "model.mlp=swiglu"],
     "model.fuse_gelu_into_fp8_cast=True needs model.mlp='gelu', got model.mlp='swiglu'"),
    (["model.fp8_head=true", "model.tie_embeddings=true"],
     "model.fp8_head=True has no effect with model.tie_embeddings=True"),
    (["model.family=llama", "model.fp8_head=true", "model.tie_embeddings=true"],
     "model.fp8_head=True has no effect with model.tie_embeddings=True"),
    (["data.seq_len=256"], "data.seq_len=256 is larger than model.max_seq_len=128"),
    (["model.vocab_size=100"], "model.vocab_size=100 is too small for byte-level text"),
    (["train.batch_ramp={start_tokens: 4096, end_tokens: 2048, ramp_steps: 5}"],
     "train.batch_ramp.start_tokens=4096 is larger than train.batch_ramp.end_tokens=2048"),
    (["train.batch_ramp={start_tokens: 512, end_tokens: 4096, ramp_steps: 5}"],
     "train.batch_ramp.end_tokens=4096 is not allowed; the ramp ends at the configured batch"),
    (["train.microbatches=4", "train.batch_ramp={start_tokens: 500, end_tokens: 2048, "
      "ramp_steps: 5}"], "train.batch_ramp.start_tokens=500 is not a multiple of 512 tokens"),
    (["train.batch_ramp.start_tokens=512"], "train.batch_ramp.end_tokens is missing"),
])
def test_impossible_combination(items, expected):
  assert expected in _error(items)


def test_bin_source_allows_any_vocab():
  cfg = load_config(None, ["model.vocab_size=100", "data.source=tokens.bin"])
  assert cfg.model.vocab_size == 100


# One value per NOT_BUILT_YET row that the row refuses.
REFUSED = {
    "model.dropout_rate": 0.1,
}


def test_refused_table_is_covered():
  assert {row[0] for row in NOT_BUILT_YET} == set(REFUSED)


@pytest.mark.parametrize("path,value", sorted(REFUSED.items()))
def test_refused_knob(path, value):
  msg = _error([f"{path}={value}"])
  assert f"{path}={value!r} is not supported yet (it needs " in msg
  assert "remove it or leave the default" in msg


def test_refused_knob_says_why():
  msg = _error(["model.dropout_rate=0.1"])
  assert "model.dropout_rate=0.1" in msg and "dropout RNG plumbing" in msg


def test_batch_ramp_schedule():
  cfg = load_config(None, ["train.microbatches=4",
                           "train.batch_ramp={start_tokens: 512, end_tokens: 2048, "
                           "ramp_steps: 100}"])
  assert cfg.train.microbatch_size == 4
  assert [cfg.batch_size_at(s) for s in (0, 49, 50, 99, 100, 10**6)] == [4, 8, 8, 12, 16, 16]
  assert [cfg.microbatches_at(s) for s in (0, 50, 100)] == [1, 2, 4]
  assert load_config(None).batch_size_at(7) == 16


def test_seed_batch_ramp_1m_to_4m_tokens():
  cfg = load_config(os.path.join(CONFIGS, "gpt_7b.yaml"), [
      "train.batch_size=2048", "train.microbatches=512",
      "train.batch_ramp={start_tokens: 1048576, end_tokens: 4194304, ramp_steps: 2000}"])
  assert cfg.train.batch_ramp == BatchRamp(2**20, 2**22, 2000)
  assert cfg.batch_size_at(0) * cfg.data.seq_len == 2**20
  assert cfg.batch_size_at(2000) * cfg.data.seq_len == 2**22


def test_level_takes_recipe_from_fp8_section():
  cfg = load_config(None, ["fp8.amax_history_len=4", "fp8.power_of_two_scales=true"])
  assert cfg.level().recipe == Recipe(amax_history_len=4, power_of_two_scales=True,
                                     fused_cast_transpose=True)
  assert load_config(None, ["train.opt_level=O0"]).level().recipe is None


def test_level_facts():
  """docs/architecture.md's level table, as the OptLevel properties the config asks."""
  facts = {name: (lvl.fp8_gemms, lvl.scaled_master, lvl.scaled_moments, lvl.fused_update,
                  [lvl.zero_stage_for(z) for z in range(4)]) for name, lvl in LEVELS.items()}
  assert facts == {
      "O0": (False, False, False, False, [0, 1, 2, 3]),
      "O1": (True, False, False, False, [0, 1, 2, 3]),
      "O2": (True, True, True, True, [0, 1, 2, 3]),
      "O3": (True, True, True, False, [1, 1, 2, 3]),
  }


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_level_rules_follow_the_level(level):
  lvl = LEVELS[level]
  cfg = load_config(None, [f"train.opt_level={level}"])
  assert cfg.train.level is lvl and cfg.zero_stage() == lvl.zero_stage_for(0)
  assert (cfg.level().recipe is not None) == lvl.fp8_gemms
  fused = [f"train.opt_level={level}", "train.fused_optimizer=true"]
  if lvl.fused_update:
    assert load_config(None, fused).train.fused_optimizer is True
  else:
    assert (f"train.fused_optimizer=True needs FP16 master weights on one device, i.e. "
            f"train.opt_level O2, not {level!r}") in _error(fused)
  fp8_comm = [f"train.opt_level={level}", "parallel.grad_comm=fp8"]
  if lvl.fp8_gemms:
    assert load_config(None, fp8_comm).grad_comm() == "fp8"
  else:
    assert (f"parallel.grad_comm='fp8' is not supported with train.opt_level={level} "
            f"(BF16 GEMMs") in _error(fp8_comm)
  offload = [f"train.opt_level={level}", "parallel.offload_optimizer=true"]
  if lvl.zero_stage:
    assert load_config(None, offload).zero_stage() == lvl.zero_stage
  else:
    assert "use zero_stage 1, 2 or 3 (or level O3)" in _error(offload)


def test_warmup_longer_than_the_run_is_clamped_with_a_notice():
  cfg = load_config(TINY, ["train.steps=3"])  # tiny.yaml warms up for 20 steps
  assert cfg.train.warmup_steps == 20 and cfg.train.warmup_in_run == 2
  assert cfg.notices() == ["train.warmup_steps=20 is longer than the run (train.steps=3); "
                           "warmup clamped to 2 steps"]
  assert load_config(TINY, ["train.steps=20"]).notices() == []
  assert load_config(TINY, ["train.steps=1"]).train.warmup_in_run == 0
  schedule = build.model_and_optimizer(cfg)[1]
  assert [float(schedule(i)) for i in range(3)] == pytest.approx([0.0, 5e-4, 1e-3])


@pytest.mark.parametrize("items, head", [
    # the key an override set, or a section it created
    (["train.learnig_rate=1e-3"], "--set train.learnig_rate=1e-3: train.learnig_rate=0.001 is "
     "not a known key; did you mean 'learning_rate'?"),
    (["trian.steps=3"], "--set trian.steps=3: trian={'steps': 3} is not a known key; did you "
     "mean 'train'?"),
    (["train.steps=5", "train.steps=-1"], "--set train.steps=-1: train.steps=-1 is not allowed"),
    (["train.batch_ramp={start_tokens: 4096, end_tokens: 2048, ramp_steps: 5}"],
     "--set train.batch_ramp={start_tokens: 4096, end_tokens: 2048, ramp_steps: 5}: "
     "train.batch_ramp.start_tokens=4096 is larger"),
    # a combination of the file's value and an override: both named
    (["model.max_seq_len=64"], "{path} with --set model.max_seq_len=64: data.seq_len=128 is "
     "larger than model.max_seq_len=64"),
    (["train.steps=abc", "train.seed=1"], "--set train.steps=abc: train.steps='abc' has type "
     "str"),
])
def test_override_errors_blame_the_override_not_the_file(items, head):
  assert _error(items, TINY).startswith(head.replace("{path}", TINY))
  without_file = _error(items)
  assert without_file.startswith(head.split(": ", 1)[0].replace("{path} with ", "")) and \
      TINY not in without_file


def test_file_errors_still_blame_the_file(tmp_path):
  path = _write(tmp_path, "train:\n  steps: -1\n")
  assert _error(["train.seed=1"], path).startswith(f"{path}: train.steps=-1 is not allowed")
