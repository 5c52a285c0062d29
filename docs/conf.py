"""Sphinx configuration: the guide, the notebooks (rendered, not run) and the API reference."""

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
autodoc_typehints = "none"  # the signatures show them; Args: says what they mean
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
# The notebooks are stored without outputs and run by the test suite, not by the build.
nb_execution_mode = "off"
html_theme = "alabaster"
html_theme_options = {"fixed_sidebar": True}
