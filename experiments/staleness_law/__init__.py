"""The staleness-learning-rate law: is t_collapse x lr constant, and how far does DIS move it?

`python -m experiments.staleness_law` runs __main__.py (its command lines and flags are
in its docstring; the flags every table script shares are
sao_jax/report/experiment.py's). Its reading: report.py: collapse times, Kaplan-Meier
medians, the censored log-normal regression (survival.py). Its committed results: RESULTS.
"""

RESULTS = ("results/staleness_law/",)  # results/<folder>/README.md says how each was run
