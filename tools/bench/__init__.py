"""The measuring harness of zmqsync: one entry point, a scenario per question.

Run from a checkout's top (``tools`` is a folder of it, not an installed package)::

    python -m tools.bench                      # the scenarios, one line each
    python -m tools.bench SCENARIO [QUESTION] [OPTIONS]   # --help on any of them

Every scenario measures its sides interleaved in one run (ways, settings or checkouts
take turns, round by round), so a shared machine's drift hits each alike; `sides` is the
runner of checkouts side by side and holds the helpers every scenario's sides use;
`storms` is the one storm script (connections or HELLOs) that the joins and the tests
start. What each scenario answers, and the scripts it grew out of, is `SCENARIOS` in
``__main__.py``; docs/benchmarks.md says which command gives which figure.

The package ships none of this: ``zmqsync bench`` is the user's quick check only.
"""
