"""The planner: what a config needs per device before anything runs.

:mod:`meshpar.plan.memory.analytic` models per-device memory by category from the abstract train state,
the layout and the model's own saved residuals; the rest of the package checks it against the
device's capacity and against XLA's ahead-of-time figures (``python -m meshpar.plan``).
"""
