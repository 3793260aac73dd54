"""The one compiled part, optional: without a C compiler zmqsync copies from Python.

ZMQSYNC_BUILD_NATIVE=0 builds a pure-Python wheel (docker/build-wheels.sh does, when the
image's Python is not the one building).
"""

import os

from setuptools import Extension, setup

native = [Extension("zmqsync._native", ["zmqsync/_native.c", "zmqsync/_follow.c"], optional=True)]
setup(ext_modules=native if os.environ.get("ZMQSYNC_BUILD_NATIVE", "1") != "0" else [])
