"""Sphinx configuration: the API reference, built from the docstrings."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import jax_lossscale  # noqa: E402

project = "jax_lossscale"
release = version = jax_lossscale.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures show them; Args: says what they mean
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
