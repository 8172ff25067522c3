"""SAO's critic against its ceiling on the graded task: the oracle per-level baseline.

`python -m experiments.baseline_ceiling` runs __main__.py (its command lines and flags
are in its docstring; the flags every table script shares are
sao_jax/report/experiment.py's). Its reading: report.py: the training-mix score, Holm
within each mix, the share of the oracle's gain SAO recovers (share.py: a ratio of paired
means with Fieller's interval); levels.py: the per-level scores. Its committed results:
RESULTS.
"""

RESULTS = ("results/baseline_ceiling/",)  # results/<folder>/README.md says how each was run
