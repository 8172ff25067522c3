r"""What a critic could explain of the harness demo's rewards: the explained variance, over
action tokens as the learner weighs them, of value predictors that know more than a critic
can (results/harness_demo/fresh_seeds/README.md).

  python -m experiments.harness_demo.critic_ceiling /tmp/hd3/gateway_s10/episodes.jsonl

Reads a gateway run's episodes.jsonl. Each episode falls in one category: no tool call,
a call whose result is the answer, a call whose result is not. Prints, per category, the
episodes and their mean reward, then the token-weighted EV of (a) E[R | category] on
every action token (a critic that knew from the first token whether and how the policy
will call), (b) that, with the reward itself on the final turn's tokens (one that also knew
the sampled answer's outcome as it is written): both above what a value of the context
can reach, so a critic's EV near 0 where these are small is the task, not the critic.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

import numpy as np


def category(episode: dict) -> str:
    answer = str(episode["task"]["answer"])
    messages = episode["messages"]
    if not any(m["role"] == "assistant" and m.get("tool_calls") for m in messages):
        return "no call"
    results = [str(m["content"]).strip() for m in messages if m["role"] == "tool"]
    return "call, right result" if answer in results else "call, wrong result"


def final_turn(mask: list[int]) -> tuple[int, int]:
    """[first, last] of the last run of action tokens in a segment's mask."""
    last = len(mask) - 1
    while last >= 0 and not mask[last]:
        last -= 1
    first = last
    while first > 0 and mask[first - 1]:
        first -= 1
    return first, last


def explained_variance(pred, ret) -> float:
    pred, ret = np.asarray(pred, float), np.asarray(ret, float)
    return float(1.0 - np.var(ret - pred) / np.var(ret))


def main(path: pathlib.Path) -> None:
    lines = path.read_text().splitlines()
    episodes = [json.loads(line) for line in lines if line.strip()]
    episodes = [e for e in episodes if e["dropped"] is None]
    cats = [category(e) for e in episodes]
    by_cat = collections.defaultdict(list)
    for c, e in zip(cats, episodes):
        by_cat[c].append(e["reward"])
    mean = {c: float(np.mean(r)) for c, r in by_cat.items()}
    print(f"{len(episodes)} episodes, mean reward {np.mean([e['reward'] for e in episodes]):.3f}")
    for c, r in sorted(by_cat.items()):
        print(f"  {c}: {len(r)} episodes, mean reward {mean[c]:.3f}")
    know_cat, know_final, ret, on_final = [], [], [], []
    for c, e in zip(cats, episodes):
        last_seg = e["segments"][-1]
        first, last = final_turn(last_seg["action_mask"])
        for seg in e["segments"]:
            for i, action in enumerate(seg["action_mask"]):
                if not action:
                    continue
                final = seg is last_seg and first <= i <= last
                know_cat.append(mean[c])
                know_final.append(e["reward"] if final else mean[c])
                ret.append(e["reward"])
                on_final.append(final)
    print(f"action tokens {len(ret)}, on the final turn {np.mean(on_final):.0%}")
    print(f"EV of E[R | category]: {explained_variance(know_cat, ret):.3f}")
    print(f"EV of E[R | category], R on the final turn: {explained_variance(know_final, ret):.3f}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not pathlib.Path(sys.argv[1]).is_file():
        print(f"critic_ceiling: needs one episodes.jsonl file, got {sys.argv[1:]}", file=sys.stderr)
        sys.exit(2)
    main(pathlib.Path(sys.argv[1]))
