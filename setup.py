"""Only for the optional C accelerator; everything else is in pyproject.toml."""

from setuptools import Extension, setup

# optional=True: without a C compiler (or, for the pump, off Linux) the install
# still succeeds and the reader and the relay use their pure-Python paths.
setup(
    ext_modules=[
        Extension("gguf._skip", ["gguf/_skip.c"], optional=True),
        Extension("studio.http.wire._pump", ["studio/http/wire/_pump.c"], optional=True),
    ]
)
