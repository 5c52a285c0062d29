"""The benchmark scripts run (at toy sizes: their figures are in benchmarks/RESULTS.md)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import benchmark_script

from jax_lossscale.demo import transformer
from jax_lossscale.demo.text import Text


@pytest.mark.parametrize("name, argv, printed", [
    ("overhead", ["--params", "1e3", "--leaves", "1", "2", "--reps", "1"], "jls.apply_gradients"),
    ("compile_time", ["--leaves", "3", "--shape", "2", "--reps", "1"], "jls.update"),
    ("compile_time", ["--leaves", "3", "--shape", "2", "--reps", "1", "--variants", "plain",
                      "unscaled in lax.cond", "updates unscaled in lax.cond"],
     "updates unscaled in lax.cond"),
    ("end_to_end", ["--batch", "64", "--hidden", "8", "--reps", "1"], "ratio"),
    ("margins", ["--steps", "50", "--seeds", "1", "--demo-steps", "2", "--margins", "0", "2"],
     "MeasuredLossScale(margin=2)"),
    ("bf16_writes", ["--params", "1e3", "--leaves", "2", "--reps", "1"],
     "bf16 compensated, state bf16"),
    ("fp8", ["--matmul", "32", "64", "32", "--batch", "2", "--width", "32", "--reps", "1",
             "--layer", "32", "64", "32", "--kernels", "2", "--no-demo-step"],
     "cuBLASLt fp8 GEMM calls: 0 of 3"),  # the bfloat16 row's, on any platform
    ("fp8_recipes", ["--steps", "2", "--batch", "4", "--context", "16", "--seeds", "0",
                     "--variants", "rowwise, e5m2 gradients"], "vs bfloat16, % (mean ± sd)")])
def test_a_benchmark_script_prints_its_table(name, argv, printed, capsys):
  benchmark_script(name).main(argv)
  assert printed in capsys.readouterr().out


def test_compile_time_always_times_plain_first_as_the_baseline_and_refuses_unknown_variants(
    capsys):
  compile_time = benchmark_script("compile_time")
  compile_time.main(["--leaves", "2", "--shape", "2", "--reps", "1", "--variants",
                     "plain + check"])
  rows = [line.split(":")[0].strip() for line in capsys.readouterr().out.splitlines()
          if ": wall" in line]
  assert rows == ["plain", "plain + check"]
  with pytest.raises(SystemExit):
    compile_time.main(["--leaves", "2", "--variants", "plain", "no such variant"])
  assert "--variants: no variant named 'no such variant'" in capsys.readouterr().err


def test_compile_time_clips_in_every_variant_under_clip():
  compile_time = benchmark_script("compile_time")
  params = {"a": jnp.ones((2, 2)), "b": jnp.ones(3)}
  grads = jax.tree.map(lambda p: p * 1e-3, params)

  def square_roots(init, step):  # Adam takes one per leaf, the global norm one more
    return str(jax.make_jaxpr(step)(params, init(params), grads)).count(" sqrt ")

  for clip_norm, expected in [(None, 2), (1.0, 3)]:
    found = {name: square_roots(*variant)
             for name, variant in compile_time.candidates(clip_norm).items()
             if name in ("plain", *compile_time.parts(optax.identity()))}
    assert found == dict.fromkeys(found, expected) and len(found) == 5, (clip_norm, found)


def test_overhead_counts_temporaries_against_the_parameters_bytes_in_their_own_dtype():
  overhead = benchmark_script("overhead")
  run = {"times": [1e-3], "bytes": 1.0, "temps": 400}
  rows = overhead.summarize({"plain": run | {"p": {"w": jnp.zeros(100, jnp.float32)}},
                             "bfloat16": run | {"p": {"w": jnp.zeros(100, jnp.bfloat16)}}})
  assert rows["plain"]["temps_vs_params"] == 1.0
  assert rows["bfloat16"]["temps_vs_params"] == 2.0  # 400 bytes against 200, not 400


def test_the_probes_benchmark_counts_what_its_probes_read_and_checks_the_plain_program():
  probes = benchmark_script("probes")
  data, config = Text.load(), transformer.Config(batch=4, context=8, layers=2)
  model = transformer.TransformerLM(config, data.vocab, transformer.FLOAT16, nnx.Rngs(0))
  tokens = transformer.held_out(data, config, seed=0)
  elements = probes.probed_elements(model, tokens)
  assert elements["all"] > 0 and set(elements) == {*probes.GROUPS, "all"}
  assert probes.unprobed_program_is_unchanged(model, tokens)


def test_the_gpu_suite_runs_every_part_at_toy_sizes_and_appends_its_tables(tmp_path, capsys):
  suite = benchmark_script("gpu_suite")
  results = tmp_path / "RESULTS.md"
  # Budgets far above the toy sizes' needs: no part stops early on a loaded machine.
  suite.main(["--smoke", "--results", str(results), "--scale", "100",
              "--parts", ",".join(str(k) for k in range(1, len(suite.PARTS) + 1))])
  printed, written = capsys.readouterr().out, results.read_text()
  assert written.startswith("\n## GPU suite: ") and "FAILED" not in printed
  for title, _, _ in suite.PARTS:
    assert f"```\n# {title}" in written
  for row in ["jls.apply_gradients", "form: cond, rows (CPU's)", "form: cond, not inlined",
              "jmp", "float16, autocast", "bfloat16, autocast", "probed", "float32",
              "fp8 rowwise", "fp8 tensorwise, XLA's", "bfloat16, fp8 options",
              "bfloat16, compensated, cond"]:
    assert f" {row} " in printed


def test_a_gpu_suite_part_that_overruns_its_budget_keeps_its_rows_and_the_next_part_runs(
    monkeypatch, capsys):
  suite = benchmark_script("gpu_suite")

  def overrunning(sizes, budget, table):
    table.rows.append("measured before the deadline")
    while True:
      budget.check()

  def next_part(sizes, budget, table):
    table.rows.append("the next part's row")

  monkeypatch.setattr(suite, "PARTS", [("slow", 0.2, overrunning), ("next", 10, next_part)])
  slow, after = suite.run_parts(suite.SMOKE)
  assert slow.rows == ["measured before the deadline"] and "stopped at its budget" in slow.notes[0]
  assert after.rows == ["the next part's row"] and not slow.failed
  assert "# stopped at its budget" in capsys.readouterr().out


def test_a_gpu_suite_part_that_fails_is_recorded_and_fails_the_run(monkeypatch, tmp_path):
  suite = benchmark_script("gpu_suite")

  def failing(sizes, budget, table):
    raise RuntimeError("no such kernel")

  monkeypatch.setattr(suite, "PARTS", [("broken", 10, failing)])
  with pytest.raises(SystemExit, match="broken"):
    suite.main(["--smoke", "--results", str(tmp_path / "R.md")])
  assert "FAILED: RuntimeError: no such kernel" in (tmp_path / "R.md").read_text()


def test_the_gpu_suite_runs_the_parts_named_by_parts_in_that_order(monkeypatch, capsys):
  suite = benchmark_script("gpu_suite")
  ran = []
  monkeypatch.setattr(suite, "PARTS", [
      (str(k), 10, lambda sizes, budget, table, k=k: ran.append(k)) for k in (1, 2, 3)])
  suite.main(["--smoke", "--parts", "3,1"])
  assert ran == [3, 1]
  for bad in ("0", "4", "1,1", "one", ""):
    with pytest.raises(SystemExit):
      suite.main(["--smoke", "--parts", bad])
  assert "--parts must be distinct part numbers from 1 to 3, comma-separated; got '4'" in (
      capsys.readouterr().err)
