"""Only for the optional C accelerator; everything else is in pyproject.toml."""

from setuptools import Extension, setup

# optional=True: without a C compiler the install still succeeds and the
# reader uses its pure-Python path.
setup(ext_modules=[Extension("gguf._skip", ["gguf/_skip.c"], optional=True)])
