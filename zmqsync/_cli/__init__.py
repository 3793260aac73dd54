"""The commands of `zmqsync`, one module each; `zmqsync.cli` parses and runs them.

Each command module has ``NAME``, ``HELP`` and ``DESCRIPTION`` (its line in ``zmqsync
--help`` and the head of its own ``--help``), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status). None imports torch or rich at module level:
``zmqsync --help`` loads them all, and operators run ``inspect``, ``sniff`` and ``gc``
in loops and containers. What they share: argument types and the bus target (`args`),
finding and asking a bus (`buses`).
"""

# Error and log lines carry the library's own context around peer text: cut them later
# than a single field.
LINE_LIMIT = 4096
