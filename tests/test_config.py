"""Config: shipped files load, YAML round trip, overrides, and one test per kind of mistake."""
import dataclasses
import glob
import os

import pytest

from fp8jax import Recipe
from fp8jax.config import (NOT_BUILT_YET, BatchRamp, Config, Fp8Section, ModelSection,
                           config_from_dict,
                           config_to_dict, load_config, save_config)

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
SHIPPED = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
TINY = os.path.join(CONFIGS, "tiny.yaml")


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
  assert {"tiny.yaml", "gpt_125m.yaml", "gpt_1_3b.yaml", "gpt_7b.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_loads(path):
  cfg = load_config(path)
  stem = os.path.splitext(os.path.basename(path))[0]
  assert cfg.runtime.name == stem and cfg.runtime.run_path == f"runs/{stem}"
  assert cfg.data.seq_len <= cfg.model.max_seq_len


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


def test_fp8_section_mirrors_every_recipe_field():
  """Every Recipe field but `calibrated` (set by the Trainer), plus the Trainer's own
  `calibrate` and `cast_weights_once`."""
  recipe_fields = [f.name for f in dataclasses.fields(Recipe) if f.name != "calibrated"]
  assert [f.name for f in dataclasses.fields(Fp8Section)] == recipe_fields + [
      "calibrate", "cast_weights_once"]


def test_model_section_matches_model_config_fields():
  from fp8jax.models.gpt import ModelConfig
  names = [f.name for f in dataclasses.fields(ModelSection)]
  assert names == [f.name for f in dataclasses.fields(ModelConfig)]
  ModelConfig(**dataclasses.asdict(ModelSection()))  # converts as the trainer does


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
    (["model.d_model=132", "model.n_heads=4"], "gives head dim 33; RoPE needs an even head dim"),
    (["data.seq_len=256"], "data.seq_len=256 is larger than model.max_seq_len=128"),
    (["train.warmup_steps=500"], "train.warmup_steps=500 is larger than train.steps=200"),
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
    "parallel.pipeline_parallel_size": 2,
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
  msg = _error(["parallel.pipeline_parallel_size=2"])
  assert "parallel.pipeline_parallel_size=2" in msg and "pipeline parallelism" in msg


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
