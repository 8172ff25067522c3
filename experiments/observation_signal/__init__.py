"""Does skipping observations lose signal when the observation is the signal?

`python -m experiments.observation_signal` runs __main__.py (its command lines and flags
are in its docstring; the flags every table script shares are
sao_jax/report/experiment.py's). Its reading: report.py: held-out success per task, the
paired difference per task with Holm over the tasks, the critic across observations. Its
committed results: RESULTS.
"""

RESULTS = ("results/observation_signal/",)  # results/<folder>/README.md says how each was run
