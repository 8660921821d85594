import subprocess
import sys

from fp8jax import cli


def test_check_reports_devices_mode_and_errors(capsys):
  assert cli.main(["check", "--shape", "64", "128", "96", "--steps", "1"]) == 0
  out = capsys.readouterr().out
  assert "cpu" in out and "FP8 GEMMs: emulated" in out
  rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
          if line.strip().startswith(("bf16 ", "fp8 "))}
  fp8_out, bf16_out = float(rows["fp8"][0]), float(rows["bf16"][0])
  assert 3 * bf16_out < fp8_out < 0.08


def test_console_script_is_installed():
  result = subprocess.run([sys.executable, "-m", "fp8jax.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0 and "check" in result.stdout
