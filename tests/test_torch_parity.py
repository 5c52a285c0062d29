"""Optional: a real `torch.amp.GradScaler` on CPU, side by side with `presets.pytorch`.

Skipped when PyTorch is not installed; CI installs torch's CPU wheel (the `[parity]` extra)
on Python 3.11 and runs it there (`.ci/run`).
"""

import jax
import numpy as np
import pytest
import test_parity

from jax_lossscale import presets

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("kwargs", [dict(init_scale=2.0**16, growth_interval=20),
                                    dict(init_scale=8.0, growth_factor=4.0,
                                         backoff_factor=0.25, growth_interval=3),
                                    dict(init_scale=2.0**16, growth_factor=1.1,
                                         backoff_factor=0.7, growth_interval=3),
                                    dict(init_scale=3.0, growth_factor=1.5,
                                         backoff_factor=0.55, growth_interval=2)])
def test_real_grad_scaler_and_preset_agree_step_by_step(kwargs):
  finite = test_parity.finite_sequence(3, kwargs["growth_interval"])[:600]
  param = torch.nn.Parameter(torch.ones(3))
  optimizer = torch.optim.SGD([param], lr=0.1)
  scaler = torch.amp.GradScaler("cpu", **kwargs)
  scales, applied, good, _ = (np.asarray(a) for a in test_parity.replay(
      presets.pytorch(**kwargs), jax.numpy.asarray(finite)))

  for i, f in enumerate(finite):
    optimizer.zero_grad()
    before = param.detach().clone()
    loss = param.sum() * (1.0 if f else float("inf"))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    stepped = not torch.equal(before, param.detach())
    assert stepped == applied[i], i
    torch_scale = np.float32(scaler.get_scale())
    if 0 < torch_scale < np.finfo(np.float32).tiny:
      # The one documented difference: PyTorch keeps a subnormal float32 scale; the
      # library flushes it to zero on every platform. The run is dead either way.
      assert scales[i] == 0, i
      break
    assert torch_scale == scales[i], i
    assert int(scaler._get_growth_tracker()) == good[i], i
  else:
    return
  assert i > 100  # the sequences compared a long stretch before getting there
