"""expstore benchmarks: ``make bench`` (``python -m benchmarks.run [--quick]``).

Each module measures one thing and can be run on its own (``python -m benchmarks.X``
prints its figures as JSON); ``run`` orchestrates them in subprocesses, so that every
measurement starts from a fresh process in the environment it is meant to see.
"""
