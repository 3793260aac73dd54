"""What to install for an optional feature, said so that it works wherever zmqsync came from.

zmqsync is not on a package index, so ``pip install 'zmqsync[metrics]'`` fails outside a
checkout: pip looks the name up on PyPI and finds nothing. An extra only adds packages
that are on the index; the hint names those (always installable), then the extra for
whoever installs zmqsync itself again, from the same checkout or wheel as before.
`EXTRAS` is checked against pyproject.toml by the tests.
"""

from __future__ import annotations

__all__ = ["EXTRAS", "install_hint"]

# extra -> the requirements it adds (pyproject.toml's optional-dependencies)
EXTRAS: dict[str, tuple[str, ...]] = {
    "metrics": ("prometheus-client>=0.20",),
    "plot": ("matplotlib>=3.7",),
    "torchrl": ("torchrl>=0.14",),
}


def install_hint(extra: str) -> str:
    """The command that installs `extra`'s packages, then how to name the extra itself:
    ``pip install 'prometheus-client>=0.20' (zmqsync's 'metrics' extra; zmqsync is not
    on PyPI, so name it by path: pip install '.[metrics]' in its checkout, or
    'PATH/TO/zmqsync-*.whl[metrics]')``."""
    packages = " ".join(f"'{requirement}'" for requirement in EXTRAS[extra])
    return (
        f"pip install {packages} (zmqsync's {extra!r} extra; zmqsync is not on PyPI, so "
        f"name it by path: pip install '.[{extra}]' in its checkout, or "
        f"'PATH/TO/zmqsync-*.whl[{extra}]')"
    )
