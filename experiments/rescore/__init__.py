"""Score a table's finished runs again on more held-out prompts (evaluation only).

`python -m experiments.rescore` runs __main__.py (its command lines and flags are in its
docstring; the flags every table script shares are sao_jax/report/experiment.py's). Its
reading: report.py: per row against SAO on the rescored prompts, beside the runs' own
evaluation. Its committed results: RESULTS.
"""

RESULTS = ("results/sao_vs_moving_average/",)  # results/<folder>/README.md says how each was run
