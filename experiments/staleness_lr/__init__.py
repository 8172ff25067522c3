"""Staleness x learning rate: when does training collapse, with and without DIS?

`python -m experiments.staleness_lr` runs __main__.py (its command lines and flags are
in its docstring; the flags every table script shares are
sao_jax/report/experiment.py's). Its reading: report.py: collapse, success, measured
staleness and keep rate per cell, DIS against no DIS. Its committed results: RESULTS.
"""

RESULTS = (
    "results/full/",
    "results/full_replication/",
)  # results/<folder>/README.md says how each was run
