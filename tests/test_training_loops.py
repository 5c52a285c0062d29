"""Real training loops on 8 devices: runs `training_loops.py` in a subprocess that forces
8 CPU devices (`XLA_FLAGS` is never set globally)."""

import pathlib
import subprocess
import sys

from helpers import clean_env

HERE = pathlib.Path(__file__).parent


def test_training_loops_on_8_forced_cpu_devices():
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       "-o", "addopts=", str(HERE / "training_loops.py")],
      env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
      capture_output=True, text=True, timeout=300, cwd=HERE,
  )
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
