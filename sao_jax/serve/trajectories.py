"""A finished gateway episode (an episodes.jsonl record) as training trajectories.

Each segment becomes one `Trajectory` (sao_jax/sampling/trajectory.py), ending in the
episode's reward: the segment's tokens and action mask as recorded; a call is a run of
action tokens (calls are separated by observation tokens: the template text between
turns, a forced tool-call prefix), numbered from 0 within the segment (`turn_ids`).
Rewards: call i's entry of `turn_rewards` (0 when none were sent) on its last action token,
plus the episode's `reward` on the segment's last call, so `outcome` = `reward` and the
last turn reward includes it, as an environment's done=True reward does. Log-probs: the
recorded ones (the temperature-1 `rollout_logp` the client received) serve as both
`rollout_logp` and `sampled_logp` (the learner reads the first). Observation tokens take
the version of the action token before them (of the first action token at the start).
A dropped episode gives no trajectories.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sao_jax.sampling.trajectory import Trajectory


def call_runs(action_mask: np.ndarray) -> list[tuple[int, int]]:
    """[(start, end)) of each run of action tokens, in order."""
    edges = np.diff(np.concatenate([[0], action_mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def episode_trajectories(record: dict[str, Any]) -> list[Trajectory]:
    if record.get("dropped") is not None or record.get("reward") is None:
        return []
    reward = float(record["reward"])
    per_call = record.get("turn_rewards")
    call = 0
    out = []
    for k, seg in enumerate(record["segments"]):
        tokens = np.asarray(seg["token_ids"], np.int32)
        mask = np.asarray(seg["action_mask"], bool)
        runs = call_runs(mask)
        turn_ids = np.full(len(tokens), -1, np.int32)
        for i, (a, b) in enumerate(runs):
            turn_ids[a:b] = i
        logp = np.asarray([x or 0.0 for x in seg["logprobs"]], np.float32)
        versions = np.zeros(len(tokens), np.int32)
        last = next(v for v, m in zip(seg["versions"], mask, strict=True) if m)
        for t, (v, m) in enumerate(zip(seg["versions"], mask, strict=True)):
            last = v if m else last
            versions[t] = last
        turn_rewards = np.zeros(len(runs), np.float32)
        if per_call is not None:
            turn_rewards[:] = per_call[call : call + len(runs)]
        turn_rewards[-1] += reward
        call += len(runs)
        out.append(
            Trajectory(
                tokens=tokens,
                action_mask=mask,
                rollout_logp=logp,
                sampled_logp=logp.copy(),
                versions=versions,
                turn_ids=turn_ids,
                turn_rewards=turn_rewards,
                outcome=reward,
                terminated=True,
                truncated=False,
                prompt_uid=f"{record['id']}/{k}",
                info={"episode": record["id"], "task": record.get("task"), "segment": k},
            )
        )
    return out
