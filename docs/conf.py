"""Sphinx configuration: the guide, the notebooks (run by the build, with their outputs and
plots) and the API reference."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import jax_lossscale  # noqa: E402

project = "jax_lossscale"
release = version = jax_lossscale.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_nb"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "notebooks/.ipynb_checkpoints"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"  # the types in the signatures; Args: says what they mean
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
# The notebooks are stored without outputs; the build runs them (once: jupyter-cache keeps
# the results until a notebook changes) so that their pages show outputs and plots.
nb_execution_mode = "cache"
nb_execution_timeout = 1800
nb_execution_raise_on_error = True
nb_execution_in_temp = True  # the notebooks write their plots where they run
html_theme = "alabaster"
html_theme_options = {"fixed_sidebar": True}


def _outputs_in_the_build_directory(app):
  """myst-nb writes executed notebooks' files and its cache beside the output directory
  (`docs/jupyter_execute/` for `sphinx-build docs docs/_build`); here they go under the
  build's doctrees, so building leaves the checkout as it was."""
  build = pathlib.Path(app.doctreedir)
  app.env.mystnb_config = app.env.mystnb_config.copy(
      output_folder=str(build / "jupyter_execute"),
      execution_cache_path=str(build / "jupyter_cache"))


def _skip_named_tuple_fields(app, what, name, obj, skip, options):
  """A NamedTuple's fields are documented by its docstring's `Attributes:`, not again as
  members ("Alias for field number 0")."""
  if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


def setup(app):
  app.connect("builder-inited", _outputs_in_the_build_directory, priority=900)
  app.connect("autodoc-skip-member", _skip_named_tuple_fields)
