"""Online learning with a moving target: SAO vs the moving-average baseline, per-user design.

`python -m experiments.online_shift` runs __main__.py (its command lines and flags are
in its docstring; the flags every table script shares are
sao_jax/report/experiment.py's). Its reading: report.py: the main table (pre-registered
family, windows, recovery curves) and the critic-tracking table. Its committed results:
RESULTS.
"""

RESULTS = (
    "results/online_shift_offsets/",
    "results/online_shift/",
)  # results/<folder>/README.md says how each was run
