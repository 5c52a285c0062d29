"""Many devices and many processes: every replica skips the same steps.

The 8-device cases live in `multidevice_cases.py` and the real training loops in
`training_loops.py`; both run in one subprocess that forces 8 CPU devices. The
multi-process case starts two `jax.distributed` processes.
"""

import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import clean_env

HERE = pathlib.Path(__file__).parent


def test_multidevice_cases_and_training_loops_on_8_forced_cpu_devices():
  # One process for both files: JAX and the frameworks start once.
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       "-o", "addopts=", str(HERE / "multidevice_cases.py"), str(HERE / "training_loops.py")],
      env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"),
      capture_output=True, text=True, timeout=400, cwd=HERE,
  )
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(args_per_process, env, timeout):
  """Starts the processes; fails fast if one dies, never waits past `timeout`."""
  procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for args in args_per_process]
  deadline = time.monotonic() + timeout
  try:
    while time.monotonic() < deadline:
      codes = [p.poll() for p in procs]
      if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    outputs = [p.communicate()[0] for p in procs]
  return [p.returncode for p in procs], outputs


def test_two_processes_skip_the_same_steps_and_end_bit_identical(tmp_path):
  port, n = free_port(), 2
  args = [[sys.executable, str(HERE / "multiprocess_worker.py"), str(i), str(n), str(port),
           str(tmp_path)] for i in range(n)]
  env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
  codes, outputs = run_processes(args, env, timeout=240)
  assert codes == [0, 0], "\n\n".join(o[-4000:] for o in outputs)

  results = [dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(n)]
  assert results[0].keys() == results[1].keys()
  for key in results[0]:
    np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
  # The inf was injected on process 1 only, at steps 2 and 5 of both patterns.
  for pattern in ("spmd", "shard_map"):
    assert list(results[0][f"{pattern}_applied"]) == [1, 1, 0, 1, 1, 0, 1, 1]


def test_a_dead_process_fails_the_run_instead_of_hanging(tmp_path):
  port = free_port()
  args = [[sys.executable, str(HERE / "multiprocess_worker.py"), "0", "2", str(port),
           str(tmp_path)],
          [sys.executable, "-c", "import sys; sys.exit(3)"]]
  start = time.monotonic()
  codes, _ = run_processes(args, clean_env(), timeout=120)
  assert codes[1] == 3 and codes[0] != 0
  assert time.monotonic() - start < 60


if __name__ == "__main__":
  sys.exit(pytest.main([__file__]))
