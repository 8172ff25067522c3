"""Table 5: advantage granularity (token-level obs-skipping GAE vs one value per turn).

`python -m experiments.gae_granularity` runs __main__.py (its command lines and flags
are in its docstring; the flags every table script shares are
sao_jax/report/experiment.py's). Its reading: report.py: the ablation table with the
paper's Table 5 rows. Its committed results: RESULTS.
"""

RESULTS = (
    "results/full/",
    "results/full_calculator/",
)  # results/<folder>/README.md says how each was run
