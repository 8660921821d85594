"""How `fp8jax` reports errors: bad input in one line with exit 2, a diagnosed run failure
with exit 1, bugs with their traceback, --debug always with it (in-process; the subprocess
checks of the real entry point are in tests/integration/test_cli.py)."""
import os

import pytest

from fp8jax import cli
from fp8jax.config import load_config


def _raised(fn):
  try:
    fn()
  except BaseException as e:  # noqa: BLE001
    return e
  raise AssertionError("nothing raised")


def _raise_in_package(error: str):
  """An error whose innermost frame is a file of the fp8jax package."""
  code = compile(f"raise {error}", os.path.join(cli.PACKAGE_DIR, "somewhere.py"), "exec")
  return _raised(lambda: exec(code))


def test_exit_codes_by_kind_of_error():
  assert cli.error_exit_code(cli.UsageError("bad flag")) == 2
  assert cli.error_exit_code(_raised(lambda: open("/no/such/file"))) == 2
  assert cli.error_exit_code(_raised(lambda: load_config(None, ["train.steps=-1"]))) == 2
  assert cli.error_exit_code(_raise_in_package("ValueError('bad value')")) == 2
  assert cli.error_exit_code(_raise_in_package("RuntimeError('cannot go on')")) == 1
  # the same types raised outside fp8jax, and other types anywhere, are bugs
  assert cli.error_exit_code(_raised(lambda: int("x"))) is None
  assert cli.error_exit_code(_raised(lambda: {}["k"])) is None
  assert cli.error_exit_code(_raise_in_package("KeyError('k')")) is None
  assert cli.error_exit_code(_raise_in_package("TypeError('t')")) is None


def test_error_line_is_one_line():
  missing = _raised(lambda: open("/no/such/file"))
  assert cli.error_line(missing) == "fp8jax: error: /no/such/file: No such file or directory"
  assert cli.error_line(ValueError("a\n  b")) == "fp8jax: error: a b"


def test_main_reports_user_errors_and_reraises_bugs(monkeypatch, capsys):
  assert cli.main(["train", "--config", "no/such.yaml"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("fp8jax: error: --config no/such.yaml: no such file")
  for argv in (["--debug", "train", "--config", "no/such.yaml"],
               ["train", "--debug", "--config", "no/such.yaml"]):
    with pytest.raises(cli.UsageError, match="no such file"):
      cli.main(argv)

  def bug(args):
    return {}["missing"]
  monkeypatch.setattr(cli, "cmd_train", bug)
  with pytest.raises(KeyError):
    cli.main(["train"])

  def ctrl_c(args):
    raise KeyboardInterrupt
  monkeypatch.setattr(cli, "cmd_train", ctrl_c)
  assert cli.main(["train"]) == 130
  assert capsys.readouterr().err.strip() == "fp8jax: interrupted"
