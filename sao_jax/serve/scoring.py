"""An episode that ends without a reward, scored by its task's registered reward.

A session's `task` (POST /v1/sessions) may name a reward of the project's registry
(sao_jax/envs/rewards.py: `math`, `exact_match`, `code_tests`, or 'module:attr'):

    {"reward": "exact_match", "answer": "42", "reward_params": {"ignore_case": true}}

When such an episode ends by `/end` or by the reward timeout, the final reply's content
(the last assistant message's text, reasoning excluded) is scored against `answer`, and the
episode is recorded with that reward (`scored_by`, `score_info`); a reward that fails
drops the episode (`reward_error`). Without one the episode is dropped as before.
"""

from __future__ import annotations

from typing import Any

import sao_jax.envs.rewards  # noqa: F401  (registers the built-in rewards)
from sao_jax.envs.base import Prompt
from sao_jax.envs.registry import RewardFn, make_reward
from sao_jax.registry import RegistryError
from sao_jax.serve.errors import invalid

TASK_FIELDS = ("reward", "answer", "reward_params")


def task_reward(task: Any) -> RewardFn | None:
    """The reward a session's task names (None when it names none); a 400 naming the
    field when the name or its parameters are bad."""
    if not isinstance(task, dict) or "reward" not in task:
        return None
    name, params = task["reward"], task.get("reward_params") or {}
    if not isinstance(name, str) or not name:
        raise invalid("task.reward", "must be the name of a registered reward")
    if not isinstance(params, dict):
        raise invalid("task.reward_params", "must be an object of the reward's parameters")
    try:
        return make_reward(name, **params)
    except RegistryError as e:
        raise invalid("task.reward", str(e)) from None
    except (TypeError, ValueError) as e:  # a factory that checks its parameters
        raise invalid("task.reward_params", str(e)) from None


def score(fn: RewardFn, task: dict, session_id: str, text: str) -> dict[str, Any]:
    """{"reward", "success", "info"} of the final text, or {"error"} when it fails."""
    prompt = Prompt(session_id, "", task.get("answer"), {"task": task})
    try:
        r = fn(text, prompt)
    except Exception as e:  # a reward's failure drops the episode; the server goes on
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"reward": float(r.score), "success": bool(r.success), "info": dict(r.info)}
