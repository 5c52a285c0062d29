"""The demos: float16 training with loss scaling matches float32; without it, gradients vanish.

A small version of the demo's model (character-level MLP on Python's bundled docs).
Tolerance: the float16 run may end within 1% of the float32 run's held-out loss.
float16 rounds every activation and weight on the way, so the two trajectories are
not identical; across seeds the gap we measured is 0.1–0.3%, so 1% leaves room for
platform differences while still catching a loss scale that loses signal (the
unscaled float16 run of the full demo ends ~7% worse).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale import demo
from jax_lossscale.demo import mlp

TOLERANCE = 0.01
CONFIG = mlp.Config(steps=100, batch=8192, hidden=64, learning_rate=1e-2)
# As long as the demo: the dynamic scale reaches its ceiling after about 60 steps and from
# there overflows every 10 to 20, which is what the measured scale saves.
LONG = dataclasses.replace(CONFIG, steps=150)


@pytest.fixture(scope="module")  # one worker runs the whole file (`--dist loadfile`)
def runs():
  return train_all({"float32": (jnp.float32, jls.NoOpLossScale()),
                    "float16": (jnp.float16, jls.NoOpLossScale()),
                    "dynamic": (jnp.float16, jls.DynamicLossScale(increment_period=10))})


@pytest.fixture(scope="module")
def long_runs():
  return train_all({"dynamic": (jnp.float16, jls.DynamicLossScale(increment_period=10)),
                    "measured": (jnp.float16, jls.MeasuredLossScale(margin=0))}, LONG)


def train_all(plan, config=CONFIG):
  data = mlp.Text.load()
  return {name: mlp.evaluate(mlp.train(name, data, config, dtype, ls, progress=False),
                              data, config, dtype)
          for name, (dtype, ls) in plan.items()}


def test_float16_with_dynamic_loss_scale_ends_within_tolerance_of_float32(runs):
  reference, scaled = runs["float32"].eval_loss, runs["dynamic"].eval_loss
  assert abs(scaled - reference) / reference < TOLERANCE, (scaled, reference)


def test_the_measured_scale_skips_fewer_steps_than_the_dynamic_one_for_the_same_loss(
    runs, long_runs):
  dynamic, measured = long_runs["dynamic"], long_runs["measured"]
  assert (~measured.applied).sum() < (~dynamic.applied).sum()
  assert abs(measured.eval_loss - dynamic.eval_loss) / dynamic.eval_loss <= 0.005
  # No more underflow: of one set of logit gradients (the float32 run's), at each step's
  # scale, averaged over the run.
  assert mean_underflow(runs, measured) <= mean_underflow(runs, dynamic)


def mean_underflow(runs, run):
  data = mlp.Text.load()
  x, y = mlp.held_out(data, CONFIG, CONFIG.batch)
  at = {s: float(mlp.logit_underflow(runs["float32"].params, x, y, jnp.float16, jnp.float32(s)))
        for s in set(run.scales)}
  return np.mean([at[s] for s in run.scales])


def test_float16_without_scaling_loses_far_more_gradient_signal(runs):
  unscaled, scaled = runs["float16"].underflow, runs["dynamic"].underflow
  assert unscaled > 0.3, unscaled  # most per-example gradients fall below 2**-24
  assert scaled < unscaled / 10, (scaled, unscaled)
  assert runs["float32"].underflow == 0


def test_each_step_records_the_scale_it_ran_with_and_the_run_the_scale_after_its_last():
  # From 2**30 every step overflows float16 (logit gradients up to about 1/64 at batch 64):
  # each is skipped and halves the scale for the next.
  run = mlp.train("float16", mlp.Text.load(), mlp.Config(steps=4, batch=64, hidden=16),
                  jnp.float16, jls.DynamicLossScale(2.0**30), progress=False)
  assert not run.applied.any()
  assert run.scales.tolist() == [2.0**30, 2.0**29, 2.0**28, 2.0**27]
  assert run.final_scale == 2.0**26


def test_the_underflow_column_measures_the_logit_gradients_of_a_training_batch():
  # d(mean loss)/d(logits) = (softmax - onehot) / batch, on a training batch's worth of
  # held-out windows, however many the loss and accuracy are measured on. At initialisation
  # the softmax is about 1/vocab everywhere: at a scale of 2**-6, 1/vocab/2048 rounds to a
  # float16 subnormal and 1/vocab/8192 to zero.
  data = mlp.Text.load()
  params = mlp.init_params(jax.random.key(0), data.vocab, 16)

  def underflow(batch, eval_size):
    run = mlp.RunResult("float16", params, losses=np.zeros(1), scales=np.ones(1),
                        applied=np.ones(1, bool), final_scale=2.0**-6)
    config = mlp.Config(batch=batch, hidden=16, eval_size=eval_size)
    return mlp.evaluate(run, data, config, jnp.float16).underflow

  assert underflow(batch=8192, eval_size=2048) == underflow(batch=8192, eval_size=8192) > 0.9
  assert underflow(batch=2048, eval_size=8192) == underflow(batch=2048, eval_size=2048) == 0


def test_demo_runs_end_to_end_and_writes_a_plot(tmp_path, capsys):
  out = tmp_path / "plot.png"
  # A few steps at CONFIG's sizes: the runs' steps are the programs the fixtures compiled,
  # loaded from the session's compilation cache (tests/conftest.py).
  demo.main(["--steps", "4", "--batch", str(CONFIG.batch), "--hidden", str(CONFIG.hidden),
             "--learning-rate", str(CONFIG.learning_rate), "--out", str(out)])
  printed = capsys.readouterr().out
  for row in ["float32", "float16, no loss scaling", "FixedLossScale", "DynamicLossScale",
              "MeasuredLossScale"]:
    assert row in printed
  assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be an integer >= 1; got 0"),
    (["--batch", "0"], "--batch must be an integer >= 1; got 0"),
    (["--hidden", "0"], "--hidden must be an integer >= 1; got 0"),
    (["--seed", "-1"], "--seed must be an integer >= 0; got -1"),
    (["--learning-rate", "0"], "--learning-rate must be a finite number > 0; got 0.0"),
    (["--out", "no such directory/plot.png"], "the directory"),
    (["--model", "transformer", "--steps", "0"], "--steps must be an integer >= 1; got 0"),
    (["--model", "transformer", "--context", "0"], "--context must be an integer >= 1; got 0"),
    (["--model", "transformer", "--layers", "0"], "--layers must be an integer >= 1; got 0"),
    (["--model", "transformer", "--seeds", "0", "-1"], "--seeds must be an integer >= 0; got -1"),
    (["--model", "transformer", "--width", "10"],
     "--width must be a multiple of the number of attention heads, 4; got 10"),
    (["--model", "transformer", "--out", "no such directory/plot.png"], "the directory"),
])
def test_an_option_out_of_range_is_refused_naming_it_before_any_training(
    argv, message, monkeypatch, capsys):
  from jax_lossscale.demo import transformer

  for module in (mlp, transformer):
    monkeypatch.setattr(module, "run_all", lambda *a, **k: pytest.fail("trained"))
  with pytest.raises(SystemExit) as exit_:
    demo.main(argv)
  assert exit_.value.code == 2
  assert message in capsys.readouterr().err


def test_the_help_names_both_demos_and_each_lists_its_own_options(capsys):
  for argv, own, other in [(["--help"], "--hidden", "--width"),
                           (["--model", "transformer", "--help"], "--width", "--hidden")]:
    with pytest.raises(SystemExit) as exit_:
      demo.main(argv)
    printed = capsys.readouterr().out
    assert exit_.value.code == 0 and "--model {mlp,transformer}" in printed
    assert own in printed and other not in printed


def test_each_kind_of_run_has_one_colour_and_line_style_in_every_plot_of_both_demos():
  from jax_lossscale.demo import transformer

  names = ["float16, FixedLossScale(32768)", "float16, MeasuredLossScale(margin=0)",
           *(name for name, *_ in transformer.plan())]
  looks = {name: tuple(sorted(demo.run_style(name).items())) for name in names}
  assert looks["float16, MeasuredLossScale(margin=0)"] == looks[
      "float16, MeasuredLossScale(margin=1)"]
  assert len(set(looks.values())) == 9, looks  # and bfloat16, float8 tensorwise and rowwise
  with pytest.raises(ValueError, match="RUN_STYLES"):
    demo.run_style("int8, a run no plot knows")


def test_the_demo_extra_provides_every_package_the_demos_import():
  # README's first command installs `.[demo]` and then runs either demo.
  import ast
  import importlib.metadata
  import pathlib
  import re
  import sys
  import tomllib

  root = pathlib.Path(demo.__file__).parents[2]
  project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
  declared = {re.match(r"[\w.-]+", r).group().lower()
              for r in project["dependencies"] + project["optional-dependencies"]["demo"]}
  distributions = importlib.metadata.packages_distributions()
  for path in pathlib.Path(demo.__file__).parent.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
      for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names):
        if top != "jax_lossscale":
          assert {d.lower() for d in distributions[top]} & declared, (path.name, top)
