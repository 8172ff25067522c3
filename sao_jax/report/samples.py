"""Rollout samples: what the policy wrote, decoded, with its rewards, per log step.

At every log step of RL the first `train.samples_per_log` trajectories of the batch just
trained on are decoded and written

* to `<workdir>/samples.jsonl`, one JSON object per trajectory:
    {"step": learner step, "prompt_uid": ..., "prompt": the context text before the first
     model turn (template included), "turns": [{"policy": a model turn, "env": the
     observation after it ("" after the last)}, ...], "reward": the outcome,
     "turn_rewards": [...], "success": bool, "truncated": bool, "truncation": the cause
     (max_len, max_turns, ...) or null, "action_tokens": n, "staleness": the learner's
     version when it trained on it minus the version of its oldest action token}
* and to TensorBoard as one markdown text summary `samples` per log step (the TEXT tab).

Tokens are decoded as the tokenizer decodes them (pad/eos/bos dropped; a chat template's
other special tokens kept, so turn markers show). A resumed run first drops the records
of steps after the restored one, as metrics.jsonl does; a fresh run starts the file anew.
Only the primary process writes.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sao_jax.metrics import truncate_jsonl

SAMPLES_FILE = "samples.jsonl"
TEXT_TAG = "samples"  # the TensorBoard text summary's tag


def _segments(traj) -> list[tuple[bool, np.ndarray]]:
    """[(is_action, tokens)] runs of the trajectory, in order."""
    mask = np.asarray(traj.action_mask, bool)
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), len(mask)]
    return [(bool(mask[a]), np.asarray(traj.tokens[a:b])) for a, b in zip(starts, ends)]


def sample_record(traj, tokenizer, step: int, version: int) -> dict[str, Any]:
    """One trajectory as a samples.jsonl record (see the module docstring); `version`:
    the learner's policy version when it trained on it."""
    segments = _segments(traj)
    prompt = tokenizer.decode(segments[0][1]) if not segments[0][0] else ""
    turns: list[dict[str, str]] = []
    for is_action, ids in segments:
        text = tokenizer.decode(ids)
        if is_action:
            turns.append({"policy": text, "env": ""})
        elif turns:
            turns[-1]["env"] = text
    return {
        "step": int(step),
        "prompt_uid": traj.prompt_uid,
        "prompt": prompt,
        "turns": turns,
        "reward": float(traj.outcome),
        "turn_rewards": [float(r) for r in traj.turn_rewards],
        "success": bool(traj.info.get("success", False)),
        "truncated": bool(traj.truncated),
        "truncation": traj.info.get("truncation"),
        "action_tokens": int(traj.num_actions),
        "staleness": int(version) - traj.min_version,
    }


def markdown(records: Sequence[dict[str, Any]]) -> str:
    """The records as one markdown text (TensorBoard renders it; fenced text verbatim)."""
    parts = []
    for r in records:
        end = f"truncated ({r['truncation']})" if r["truncated"] else "terminated"
        head = (
            f"**{r['prompt_uid']}**: reward {r['reward']:.3g}, success {r['success']}, {end}, "
            f"{r['action_tokens']} action tokens, staleness {r['staleness']}"
        )
        body = [r["prompt"]] + [t["policy"] + t["env"] for t in r["turns"]]
        parts.append(head + "\n\n```\n" + "".join(body).replace("```", "'''") + "\n```")
    return "\n\n".join(parts)


class SampleWriter:
    """Writes `n` decoded trajectories per log step to samples.jsonl and a metric
    writer's text summaries (a clu MetricWriter: TensorBoard keeps them)."""

    def __init__(
        self,
        workdir: str | pathlib.Path,
        tokenizer,
        n: int,
        *,
        resume_step: int,
        primary: bool | None = None,
    ):
        primary = jax.process_index() == 0 if primary is None else primary
        self.tokenizer, self.n = tokenizer, n if primary else 0
        self.path = pathlib.Path(workdir) / SAMPLES_FILE
        if self.n:
            truncate_jsonl(self.path, resume_step)

    def write(self, step: int, version: int, trajs: Sequence, writer=None) -> list[dict]:
        """Records of the first n of `trajs` at `step` (the learner step after the update
        that trained on them at `version`), appended to the file and sent to
        `writer.write_texts`."""
        if not self.n or not trajs:
            return []
        records = [sample_record(t, self.tokenizer, step, version) for t in trajs[: self.n]]
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if writer is not None:
            writer.write_texts(step, {TEXT_TAG: markdown(records)})
        return records
