"""experiments/harness_demo/critic_ceiling.py against a literal count: three episodes, the
categories, the final turn and both predictors' explained variance worked by hand."""

import json

import pytest

from experiments.harness_demo import critic_ceiling as cc


def _episode(reward, mask, tool=None, answer=6):
    messages = [{"role": "user", "content": "q:2*3"}]
    if tool is not None:
        call = {"id": "c", "type": "function", "function": {"name": "calculator"}}
        messages += [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": tool}]
    messages.append({"role": "assistant", "content": "6"})
    return {"task": {"answer": answer}, "dropped": None, "reward": reward, "messages": messages,
            "segments": [{"action_mask": mask}]}  # fmt: skip


def test_ceiling_by_hand(tmp_path, capsys):
    eps = [
        _episode(0.0, [0, 0, 1, 1]),
        _episode(1.0, [0, 1, 1, 0, 1], tool="6"),
        _episode(0.0, [0, 1, 1, 0, 1], tool=" 6 "),
        {**_episode(1.0, [1]), "dropped": "x"},
    ]
    right = "call, right result"
    assert [cc.category(e) for e in eps[:3]] == ["no call", right, right]
    assert cc.category(_episode(0.0, [1], tool="7")) == "call, wrong result"
    assert cc.final_turn([0, 1, 1, 0, 1, 1, 0]) == (4, 5)
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    cc.main(path)
    out = capsys.readouterr().out
    # returns over action tokens [0, 0, 1, 1, 1, 0, 0, 0]: Var 15/64. E[R | category]
    # predicts [0, 0, .5 x 6]: residual mean square 12/64 -> EV 1/5; with R on the final
    # turns' tokens (the first episode's two, the 5th, the 8th: half) 8/64 -> EV 7/15.
    # The dropped episode is not read.
    assert "3 episodes" in out and "on the final turn 50%" in out
    assert f"EV of E[R | category]: {1 / 5:.3f}" in out
    assert f"R on the final turn: {7 / 15:.3f}" in out
    assert cc.explained_variance([1.0, 0.0], [1.0, 0.0]) == pytest.approx(1.0)
