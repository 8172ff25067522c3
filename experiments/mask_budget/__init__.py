"""Fixed band vs entropy-scaled band at a matched mask budget: DIS, ESTR and IcePop.

`python -m experiments.mask_budget` runs __main__.py (its command lines and flags are in
its docstring; the flags every table script shares are sao_jax/report/experiment.py's).
Its reading: report.py: achieved mask share, keep rate, masked/kept entropy, collapse,
success, each rule against DIS. Its committed results: RESULTS.
"""

RESULTS = ("results/mask_budget/",)  # results/<folder>/README.md says how each was run
