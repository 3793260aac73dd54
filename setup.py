"""The compiled parts, both optional: without a C compiler zmqsync copies from Python;
without a C++ compiler a flat publish checks its tensors' addresses from Python.

`_native` is C. `_places_native` is C++ only to catch the exceptions of the torch
function it calls (see zmqsync/_places.cpp), and apart so that a missing C++ compiler
costs only that check. ZMQSYNC_BUILD_NATIVE=0 builds a pure-Python wheel
(docker/build-wheels.sh does, when the image's Python is not the one building).
"""

import os

from setuptools import Extension, setup

SOURCES = ["_native.c", "_cast.c", "_follower.c", "_gate.c", "_ack_reader.c"]
native = [
    Extension(
        "zmqsync._native",
        [f"zmqsync/{name}" for name in SOURCES],
        depends=[f"zmqsync/{name}" for name in ("_gate.h", "_libzmq.h", "_msgpack_read.h", "_plan.h")],
        optional=True,
    ),
    Extension("zmqsync._places_native", ["zmqsync/_places.cpp"], optional=True),
]
setup(ext_modules=native if os.environ.get("ZMQSYNC_BUILD_NATIVE", "1") != "0" else [])
