"""Scores of the graded task (sao_jax/envs/levels.py) on the training stream's mix of levels.

The evaluation logs held-out success per level (`eval/sampled_success_level<k>`,
sao_jax/run/evaluation.py). The held-out split does not hold the levels in the training
stream's proportions (it holds fewer of the easy levels the larger it is: level 1 has
few distinct problems), while the training stream draws the four levels alike
(configs/sao.py); so the score on the training mix is the plain mean of the per-level
successes, and the raw held-out score is reported beside it.
"""

from __future__ import annotations

import numpy as np

from sao_jax.report import tables

LEVEL = "eval/sampled_success_level"  # + k: success on the level-k prompts (evaluation.py)
UNIFORM = "eval/sampled_success_level_uniform"  # their mean: every level weighted alike


def is_level(key: str) -> bool:
    """`key` is a per-level success (LEVEL + the level's number)."""
    return key.startswith(LEVEL) and key[len(LEVEL) :].isdigit()


def with_uniform(scores: dict[str, float]) -> dict[str, float]:
    """`scores` plus UNIFORM where per-level successes are there (the levels task)."""
    per = [v for k, v in scores.items() if is_level(k)]
    return {**scores, UNIFORM: float(np.mean(per))} if per else scores


def training_mix_at(history: tables.History, step: int) -> float | None:
    """The mean over levels of a run's logged per-level held-out success at `step` (None
    when the run logged no level there, or not every level it logged elsewhere)."""
    keys = sorted({k for record in history for k in record if is_level(k)})
    per = [tables.value_at(history, k, step) for k in keys]
    if not per or any(v is None for v in per):
        return None
    return float(np.mean(per))
