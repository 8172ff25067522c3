"""Table 4: SAO against its ablations and baselines on the embedded agentic task.

`python -m experiments.ablations` runs __main__.py (its command lines and flags are in
its docstring; the flags every table script shares are sao_jax/report/experiment.py's).
Its reading: report.py: the ablation table (paper columns, Holm over the rows,
collapses, mechanisms), also read by the other table scripts' reports, as are
collapse.py (the collapse rule and the table of every run) and plots.py (the tables'
plots). Its committed results: RESULTS.
"""

RESULTS = (
    "results/full/",
    "results/full_replication/",
    "results/sao_vs_moving_average/",
)  # results/<folder>/README.md says how each was run
