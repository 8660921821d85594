"""`fp8jax eval` and `fp8jax generate` on a run of configs/tiny.yaml trained here for a few
steps (its checkpoint, its FP8 state, its data) and on the tiny LLaMA fixture; one-line errors
for a missing checkpoint or tokenizer; a resume on other data is refused."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import cli
from fp8jax.config import load_config
from fp8jax.models import decode
from fp8jax.train import inference
from fp8jax.train.loop import Trainer

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "llama_gqa")
STEPS = 3
# tiny.yaml as shipped (4 x 128 GPT at O1, 16 x 128-token batches), shortened: STEPS steps on
# 300 kB of the stdlib corpus, a checkpoint at the end, its validation loss over 4 batches.
OVERRIDES = [f"train.steps={STEPS}", "train.warmup_steps=1", "train.eval_every=0",
             "train.eval_batches=4", "train.fp8_health_every=0", "data.max_bytes=300000",
             f"checkpoint.checkpoint_every_n_steps={STEPS}", "checkpoint.async_save=false"]


def _config(run_dir, *extra):
  return load_config(os.path.join(CONFIGS, "tiny.yaml"),
                     [*OVERRIDES, f"runtime.run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The run folder of STEPS steps of configs/tiny.yaml, and its final validation loss."""
  run_dir = tmp_path_factory.mktemp("tiny") / "run"
  Trainer(_config(run_dir), progress=False).run()
  with open(run_dir / "metrics.jsonl") as f:
    val = [json.loads(line)["val_loss"] for line in f if "val_loss" in line]
  return str(run_dir), val[-1]


def test_eval_reproduces_the_runs_validation_loss(run, capsys):
  """At the run's level with its checkpoint's FP8 state, the first 4 validation batches give
  the loss the Trainer logged for them; bits per byte and perplexity follow from it; BF16
  (O0) is within FP8's error of it."""
  run_dir, val_loss = run
  assert cli.main(["eval", run_dir, "--batches", "4", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert (out["model"], out["step"], out["level"]) == (f"step {STEPS} of {run_dir}", STEPS, "O1")
  assert out["fp8_state"] == "FP8 scales of the O1 run's checkpoint"
  assert (out["batches"], out["batch_size"], out["seq_len"], out["tokens"]) == \
      (4, 16, 128, 4 * 16 * 128)
  assert out["data"] == "Python stdlib source" and out["split"] == "val"
  assert abs(out["loss"] - val_loss) < 1e-4 * val_loss, (out["loss"], val_loss)
  assert out["bits_per_byte"] == pytest.approx(out["loss"] / np.log(2), rel=1e-12)
  assert out["perplexity"] == pytest.approx(np.exp(out["loss"]), rel=1e-12)
  assert cli.main(["eval", run_dir, "--batches", "4", "--level", "o0"]) == 0
  line = capsys.readouterr().out.strip()
  assert line.startswith(f"fp8jax eval: step {STEPS} of {run_dir} at O0: loss ")
  assert line.endswith("over 4 batches of 16 x 128 tokens of the val split of Python stdlib "
                       "source")
  bf16 = float(line.split(" loss ")[1].split()[0])
  assert abs(bf16 - val_loss) < 0.02 * val_loss


def test_a_bf16_view_of_the_run_calibrates_fp8_by_forward_passes(run):
  """The run's weights without its FP8 state, evaluated at O1: scales from forward passes
  over train batches only; the loss stays within FP8's error of the checkpoint-scaled one."""
  run_dir, val_loss = run
  loaded = inference.load(run_dir)
  data = inference.eval_data(loaded, None)
  own = inference.evaluate(*loaded.at_level("O1")[:2], data.batches("val", 4), byte_level=True)
  loaded.fp8 = None
  model, variables, note = loaded.at_level("O1", (b[:, :-1] for b in data.batches("train", 2)))
  assert note == "FP8 scales calibrated on 2 forward passes"
  calibrated = inference.evaluate(model, variables, data.batches("val", 4))
  assert abs(calibrated.loss - own.loss) < 0.02 * own.loss
  assert abs(own.loss - val_loss) < 1e-4 * val_loss


def test_generate_is_greedy_and_cached_like_full_recomputation(run, capsys):
  """At temperature 0 the CLI prints the text of the library's greedy tokens, which are the
  argmax of the full model's logits recomputed for every prefix (the run's O1 model, its FP8
  state)."""
  run_dir, _ = run
  assert cli.main(["generate", run_dir, "--prompt", "def main(", "--max-new-tokens", "24",
                   "--temperature", "0"]) == 0
  first = capsys.readouterr()
  assert f"fp8jax generate: step {STEPS} of {run_dir} at O1 (FP8 scales of the O1 run's " \
         "checkpoint), byte-level ids: " in first.err and "greedy" in first.err
  loaded = inference.load(run_dir)
  model, variables, _ = loaded.at_level()
  ids = inference.prompt_ids(loaded.codec(), "def main(")
  assert ids[0, 0] == 0 and bytes(ids[0, 1:].tolist()) == b"def main("  # after a separator
  tokens, logits = decode.generate(model, variables, ids, max_new_tokens=24)
  seq = jnp.concatenate([jnp.asarray(ids), tokens], axis=1)
  full = np.asarray(jax.jit(model.apply)(variables, seq[:, :-1]))[:, ids.shape[1] - 1:]
  np.testing.assert_array_equal(np.asarray(tokens), full.argmax(-1))
  np.testing.assert_allclose(np.asarray(logits), full, atol=2e-2, rtol=0)
  text = inference.Codec().decode(np.asarray(tokens)[0].tolist()).split("\0")[0]
  assert first.out == "def main(" + text + "\n"


def test_llama_fixture_through_the_cli(capsys):
  """hf:DIR: eval at O1 calibrates on forward passes; generate needs a tokenizer (one line
  saying how to give one), then samples with a key/value cache."""
  spec = f"hf:{FIXTURE}"
  assert cli.main(["eval", spec, "--data", "stdlib", "--max-bytes", "60000", "--tokenizer",
                   "bytes", "--batches", "2", "--seq-len", "64", "--level", "O1",
                   "--calibration-batches", "1"]) == 0
  line = capsys.readouterr().out.strip()
  assert line.startswith(f"fp8jax eval: {spec} at O1 (FP8 scales calibrated on 1 forward "
                         "pass): loss ")
  assert "bits/byte over 2 batches of 8 x 64 tokens of the val split" in line
  assert cli.main(["generate", spec, "--prompt", "x"]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"fp8jax: error: {spec}: no tokenizer ({FIXTURE} holds no tokenizer.json); pass "
      "--tokenizer PATH (a tokenizer.json), or --tokenizer bytes for byte-level ids"]
  assert cli.main(["generate", spec, "--prompt", "x", "--tokenizer", "bytes",
                   "--max-new-tokens", "6", "--temperature", "1.0", "--top-k", "5"]) == 0
  out = capsys.readouterr()
  assert out.out.startswith("x") and "byte-level ids: " in out.err
  assert "temperature 1, top-k 5" in out.err


def test_missing_checkpoint_and_tokenizer_are_one_line_errors(run, tmp_path, capsys):
  run_dir, _ = run
  bare = tmp_path / "bare"
  bare.mkdir()
  shutil.copy(os.path.join(run_dir, "config.yaml"), bare / "config.yaml")
  cases = [
      (["eval", str(bare)], f"{bare} has no checkpoint in {bare}/checkpoints: train with "
                            "checkpoint.checkpoint_every_n_steps > 0"),
      (["eval", str(tmp_path / "none")], f"{tmp_path / 'none'} does not exist: pass a run "
                                         "folder that fp8jax train wrote"),
      (["generate", run_dir, "--prompt", "a", "--step", "2"],
       f"{run_dir} has no checkpoint of step 2; its steps: {STEPS}"),
      (["eval", f"hf:{tmp_path}/nothing", "--data", "stdlib"],
       f"hf:{tmp_path}/nothing: no such folder"),
      (["generate", run_dir, "--prompt", "a", "--tokenizer", str(tmp_path / "t.json")],
       f"step {STEPS} of {run_dir}: tokenizer '{tmp_path / 't.json'}' does not exist"),
  ]
  moved = tmp_path / "moved"  # the run's own tokenizer, gone
  shutil.copytree(run_dir, moved)
  text = (moved / "config.yaml").read_text().replace("tokenizer: null",
                                                     f"tokenizer: {tmp_path}/gone.json")
  (moved / "config.yaml").write_text(text)
  cases.append((["generate", str(moved), "--prompt", "a"],
                f"step {STEPS} of {moved}: tokenizer '{tmp_path}/gone.json' (the run's "
                f"data.tokenizer, {moved}/config.yaml) does not exist; pass --tokenizer PATH"))
  for args, message in cases:
    assert cli.main(args) == 2, args
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fp8jax: error: {message}"), (args, err)


def test_resuming_on_other_data_is_refused(run, tmp_path, capsys):
  """The checkpoint records the data's fingerprint: the same run resumed with another cap
  (other bytes) stops before training with one line naming both."""
  run_dir, _ = run
  copy = tmp_path / "copy"
  shutil.copytree(run_dir, copy)
  config = _config(copy, "data.max_bytes=200000", "checkpoint.auto_resume=true",
                   f"train.steps={STEPS + 2}")
  with pytest.raises(ValueError) as e:
    Trainer(config, progress=False).run()
  message = str(e.value)
  assert message.startswith(f"the checkpoints in {copy}/checkpoints were trained on other "
                            "data: Python stdlib source (")
  assert "300,000 bytes, fingerprint" in message and "200,000 bytes, fingerprint" in message
  assert "\n" not in message
  # (its config.yaml now says 200 kB) eval says the split is not the run's
  assert cli.main(["eval", str(copy), "--batches", "1", "--level", "O0"]) == 0
  err = capsys.readouterr().err
  assert f"fp8jax eval: warning: step {STEPS} of {copy} was trained on other data (" in err


def test_a_run_longer_than_its_data_says_how_many_epochs(tmp_path, capsys):
  """STEPS x 16 windows of 128 tokens from 5 kB of text (37 windows a training epoch): the
  start says the run reads its training split 1.30 times."""
  trainer = Trainer(_config(tmp_path / "short", "data.max_bytes=5000"), progress=False)
  windows = trainer.train_batches.windows_per_epoch
  assert trainer.epochs() == pytest.approx(STEPS * 16 / windows) and trainer.epochs() > 1
  trainer._print_start(0, primary=True)
  out = capsys.readouterr().out
  assert (f"fp8jax train: data: the run's {STEPS * 16 * 128:,} training tokens are "
          f"{trainer.epochs():.2f} epochs of the {len(trainer.data.train):,} of Python stdlib "
          "source (") in out
