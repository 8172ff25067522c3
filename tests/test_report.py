"""The end-of-run report: markdown, PNG plots, skipped absent series, determinism."""

import re

import matplotlib.image
import numpy as np
import pytest

from sao_jax.metrics import JsonlWriter
from sao_jax.report import run_report as R
from sao_jax.report.run_report import PRETRAIN_STEP, STALENESS_HIST_PREFIX
from sao_jax.run import value_pretrain

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BUCKETS = ("0", "1", "2", "3_4", "5_8", "gt8")


def _history(steps=12):
    rng = np.random.default_rng(0)
    out = []
    for s in range(1, steps + 1):
        rec = {
            "step": s,
            "time": 100.0 + s,
            "train/reward": float(rng.random()),
            "train/success": s / steps,
            "batch/outcome": float(rng.random()),
            "critic/value_loss": 1.0 / s,
            "critic_first/value_loss": 1.2 / s,
            "critic/ev_pre_update": 0.1 * s / steps,
            "critic/explained_variance": None if s == 3 else 0.5,
            "policy/keep_rate": 0.9,
            "skipped": 0.0 if s != 5 else 1.0,
            f"{STALENESS_HIST_PREFIX}0": 4 * s,
            f"{STALENESS_HIST_PREFIX}1": 2 * s,
        }
        rec |= {f"policy/keep_rate_stale_{b}": 1.0 - 0.1 * i for i, b in enumerate(BUCKETS)}
        out.append(rec)
        if s % 4 == 0:
            out.append({"step": s, "eval/greedy_success": s / 20, "eval/sampled_success": s / 30})
    return out


SUMMARY = {
    "machine": "cpu x2",
    "wall_time_s": 3725.4,
    "eval_success_before": 0.125,
    "eval_success_after": 0.5,
    "steps": 12,
    "config": "configs/sao.py:smoke",
}


def _images(md):
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def test_report_writes_markdown_and_pngs(tmp_path):
    path = R.write_report(tmp_path, history=_history(), summary=SUMMARY, title="Smoke run")
    md = path.read_text()
    assert path == tmp_path / "report.md" and md.startswith("# Smoke run\n")
    images = _images(md)
    stems = [
        "success", "reward", "value_loss", "explained_variance", "keep_rate",
        "keep_rate_staleness", "staleness_hist", "skipped",
    ]  # fmt: skip
    assert images == [f"plots/{s}.png" for s in stems]
    for rel in images:
        assert (tmp_path / rel).read_bytes()[:8] == PNG_MAGIC
    # summary table: known rows first, in order, then others
    rows = [line for line in md.splitlines() if line.startswith("| ") and "|---" not in line]
    assert rows[1:7] == [
        "| Eval success before training | 0.125 |",
        "| Eval success after training | 0.5 |",
        "| Steps | 12 |",
        "| Wall time | 1h 02m 05s (3725 s) |",
        "| Machine | cpu x2 |",
        "| config | configs/sao.py:smoke |",
    ]
    assert "| eval/greedy_success | 12 | 0.6 |" in md
    assert "| critic/explained_variance | 12 | 0.5 |" in md


def test_report_is_deterministic(tmp_path):
    a = R.write_report(tmp_path / "a", history=_history(), summary=SUMMARY).read_text()
    b = R.write_report(tmp_path / "b", history=_history(), summary=SUMMARY).read_text()
    assert a == b and "100." not in a  # record times are not in the markdown


def test_absent_series_are_skipped(tmp_path):
    R.write_report(tmp_path, history=_history(3))
    assert (tmp_path / "plots" / "success.png").exists()
    history = [{"step": s, "train/reward": 0.1 * s, "policy/loss": None} for s in range(4)]
    md = R.write_report(tmp_path, history=history).read_text()
    assert _images(md) == ["plots/reward.png"]
    assert (tmp_path / "plots" / "success.png").exists()  # an old plot is kept, unlinked
    assert "## Summary" not in md and "policy/loss" not in md


def test_success_plot_has_a_panel_per_concern(tmp_path):
    """Overall and per-level success in two panels; every line its own colour (per level:
    the level's colour, one line style per decoding mode); legends outside the axes."""
    modes, levels = ("greedy", "sampled"), (1, 2, 3, 4)
    history = [
        {
            "step": s,
            "train/success": 0.1 * s,
            **{f"eval/{m}_success": 0.2 * s for m in modes},
            **{f"eval/{m}_success_level{k}": s / (k + 1) for m in modes for k in levels},
        }
        for s in range(3)
    ]
    names = sorted(n for n in history[0] if n != "step")
    panels = R.split_levels(R.collect_series(history, names))
    assert [(title, len(group)) for title, group in panels] == [("overall", 3), ("per level", 8)]
    overall, per_level = (R._styles(list(group)) for _, group in panels)
    assert len({s["color"] for s in overall}) == 3
    assert len({(s["color"], s["linestyle"]) for s in per_level}) == 8
    assert len({s["color"] for s in per_level}) == 4  # one colour per level
    R.write_report(tmp_path, history=history)
    height, width, _ = matplotlib.image.imread(tmp_path / "plots" / "success.png").shape
    assert height > 600 and width > 700  # two panels, legends right of the data
    assert R.split_levels({"train/reward": ([0], [1.0])}) == [("", {"train/reward": ([0], [1.0])})]


def test_report_reads_metrics_jsonl(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        R.write_report(tmp_path)
    w = JsonlWriter(tmp_path / "metrics.jsonl")
    for s in range(5):
        w.write_scalars(s, {"critic/value_loss": 1.0 / (s + 1), "skipped_steps": s // 2})
    w.close()
    md = R.write_report(tmp_path, staleness_hist={0: 3, 2: 1}).read_text()
    assert _images(md) == ["plots/value_loss.png", "plots/staleness_hist.png", "plots/skipped.png"]
    assert "| skipped_steps | 4 | 2 |" not in md  # cumulative skips are plotted, not tabled


def test_train_loop_summary(tmp_path):
    summary = {
        "steps": 12,
        "before": {"eval/greedy_success": 0.25, "eval/greedy_reward": 0.5},
        "after": {"eval/greedy_success": 0.75, "eval/greedy_reward": 0.9, "eval/seconds": 2.0},
        "last_train": {"train/reward": 0.8},
        "counters": {"generated": 40, "trained": 36},
        "staleness_hist": {"0": 30, "1": 6},  # as read back from summary.json
        "wall_time_s": 59.6,
        "interrupted": False,
    }
    history = [{"step": s, "train/reward": 0.1 * s} for s in range(3)]
    md = R.write_report(tmp_path, history=history, summary=summary).read_text()
    assert "| eval/greedy_success | 0.25 | 0.75 |" in md
    assert "| eval/seconds | n/a | 2 |" in md
    assert "| counters/generated | 40 |" in md and "| Interrupted | False |" in md
    assert "| Wall time | 0h 01m 00s (60 s) |" in md
    assert "last_train" not in md and "0.8" not in md
    assert _images(md) == ["plots/reward.png", "plots/staleness_hist.png"]


def test_value_pretraining_gets_its_own_plots_and_table(tmp_path):
    history = [{"step": 0, "eval/greedy_success": 0.1}]
    for k in range(21):  # logged at RL step 0 with their own counter
        rec = {"step": 0, PRETRAIN_STEP: k, "value_pretrain/lr": 1e-3}
        if k:
            rec["value_pretrain/batch/explained_variance"] = 0.01 * k
            rec["value_pretrain/batch/value_loss"] = 1.0 / k
        if k % 5 == 0:
            rec["value_pretrain/heldout/explained_variance"] = 0.02 * k
            rec["value_pretrain/heldout/best_explained_variance"] = 0.02 * k
            rec["value_pretrain/heldout/value_loss"] = 2.0 / (k + 1)
            rec["value_pretrain/rollouts"] = 64 * k
        history.append(rec)
    history += [{"step": s, "critic/ev_pre_update": 0.3, "critic/ev_post_update": 0.5}
                for s in (1, 2)]  # fmt: skip
    summary = {"value_pretrain": {"steps": 20, "stop_reason": "reached value_pretrain.steps=20"}}
    md = R.write_report(tmp_path, history=history, summary=summary).read_text()
    assert _images(md) == [
        "plots/success.png", "plots/explained_variance.png", "plots/value_pretrain_ev.png",
        "plots/value_pretrain_loss.png",
    ]  # fmt: skip
    table = md.split("## Value pretraining")[1].split("##")[0]
    assert table.count("\n| ") == 6  # header + evaluations at 0, 5, 10, 15, 20
    assert "| 20 | 0.4 | 0.4 | 0.2 | 0.09524 | 1280 |" in table
    last = md.split("## Last logged values")[1]
    assert "value_pretrain/" not in last and "| critic/ev_pre_update | 2 | 0.3 |" in last
    assert "| value_pretrain/stop_reason | reached value_pretrain.steps=20 |" in md
    assert value_pretrain.STEP_KEY == PRETRAIN_STEP


def test_empty_history(tmp_path):
    md = R.write_report(tmp_path, history=[], summary={"steps": 0}).read_text()
    assert "No metrics logged." in md and "No series to plot." in md and _images(md) == []


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"history\[1\]"):
        R.write_report(tmp_path, history=[{"step": 0}, {"loss": 1.0}])
    with pytest.raises(ValueError, match="staleness_hist"):
        R.write_report(tmp_path, history=[{"step": 0}], staleness_hist={-1: 2})


def test_series_helpers():
    names = [f"policy/keep_rate_stale_{b}" for b in reversed(BUCKETS)]
    assert [n.rsplit("_stale_", 1)[1] for n in sorted(names, key=R._stale_order)] == list(BUCKETS)
    history = [
        {"step": 10, "skipped": 0.1},
        {"step": 20, "skipped": 0.0},
        {"step": 25, "skipped": 0.2},
    ]
    ((steps, cum),) = R.skipped_series(history).values()
    assert steps == [10, 20, 25] and np.allclose(cum, [1.0, 1.0, 2.0])
    assert R.staleness_from_history(_history(2)) == {0: 8, 1: 4}  # the last record
    series = R.collect_series([{"step": 2, "x": 1.0}, {"step": 1, "x": 3}, {"step": 3}], ["x"])
    assert series == {"x": ([1, 2], [3.0, 1.0])}
