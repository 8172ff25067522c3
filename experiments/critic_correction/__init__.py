"""A stale-critic correction: BRACE-style critic targets against lambda = 1 targets.

`python -m experiments.critic_correction` runs __main__.py (its command lines and flags
are in its docstring; the flags every table script shares are
sao_jax/report/experiment.py's). Its reading: report.py: per cell, BRACE minus lambda in
the critic's EV and in success, Holm within each family. Its committed results: RESULTS.
"""

RESULTS = ("results/critic_correction/",)  # results/<folder>/README.md says how each was run
