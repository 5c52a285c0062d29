"""The benchmark scripts run (at toy sizes: their figures are in benchmarks/RESULTS.md)."""

import importlib.util
import pathlib
import sys

import pytest
from flax import nnx

from jax_lossscale.demo import transformer
from jax_lossscale.demo.text import Text

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"


def script(name: str):
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
  module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


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
             "--layer", "32", "64", "32"], "cuBLASLt fp8 GEMM")])
def test_a_benchmark_script_prints_its_table(name, argv, printed, capsys):
  script(name).main(argv)
  assert printed in capsys.readouterr().out


def test_the_probes_benchmark_counts_what_its_probes_read_and_checks_the_plain_program():
  probes = script("probes")
  data, config = Text.load(), transformer.Config(batch=4, context=8, layers=2)
  model = transformer.TransformerLM(config, data.vocab, transformer.FLOAT16, nnx.Rngs(0))
  tokens = transformer.held_out(data, config, seed=0)
  elements = probes.probed_elements(model, tokens)
  assert elements["all"] > 0 and set(elements) == {*probes.GROUPS, "all"}
  assert probes.unprobed_program_is_unchanged(model, tokens)
