"""A table whose tests are not read (a pilot: no pre-registration beside its runs file; or
incomplete: a pre-registered run missing) prints that status in every test cell (p, Holm
p, verdict), not only in its header: each pre-registered table's report, written again
in-process from its committed runs file (sao_jax/report/experiment.py `replay`) in a
folder without its pre-registration, and with one pre-registered run dropped."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
from sao_jax.experiments.baseline_ceiling import report as baseline_ceiling
from sao_jax.experiments.critic_correction import report as critic_correction
from sao_jax.experiments.mask_budget import report as mask_budget
from sao_jax.experiments.observation_signal import report as observation_signal
from sao_jax.experiments.online_shift import report as online_shift
from sao_jax.experiments.staleness_law import report as staleness_law

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.configs import observation_signal as observation_cfg
from sao_jax.configs import online_shift as shift_cfg
from sao_jax.report import audit
from sao_jax.report.experiment import INCOMPLETE, PILOT, Experiment, replay
from sao_jax.rl import mask_budget as mb

ROOT = pathlib.Path(__file__).resolve().parents[1]
CALIBRATION = "mask_budget_calibration.json"


def _mask_budget_report(exp, spec, results, wall_s):
    path = pathlib.Path(exp.prereg_folder) / CALIBRATION
    budgets = ablations_cfg.MASK_BUDGETS[exp.mode]
    levels = dict(zip(budgets, mb.read_levels(path, budgets), strict=True))
    return mask_budget.report(
        exp, spec, results, wall_s, calibration=mb.read_calibration(path), levels=levels,
        calibration_steps=ablations_cfg.calibration_steps(exp.mode),
    )  # fmt: skip


TABLES = {  # name: (sweep of a mode, report), as experiments/<name>/__main__.py runs them
    "critic_correction": (
        lambda mode: (
            ablations_cfg.get_sweep(f"table=brace_staleness,mode={mode}"),
            shift_cfg.get_sweep(f"table=brace,mode={mode},offsets=none"),
        ),
        critic_correction.report,
    ),
    "observation_signal": (observation_cfg.sweeps, observation_signal.report),
    "mask_budget": (
        lambda mode: ablations_cfg.get_sweep(
            f"table=mask_budget,mode={mode},calibration={ROOT}/results/mask_budget/{CALIBRATION}"
        ),
        _mask_budget_report,
    ),
    "staleness_law": (
        lambda mode: ablations_cfg.get_sweep(f"table=staleness_law,mode={mode}"),
        staleness_law.report,
    ),
    "baseline_ceiling": (
        lambda mode: ablations_cfg.get_sweep(f"table=baseline_ceiling,mode={mode}"),
        baseline_ceiling.ceiling_report,
    ),
    "online_shift_main": (  # the offsets design's main table (results/online_shift_offsets)
        lambda mode: shift_cfg.get_sweep(f"table=main,offsets=spread,mode={mode}"),
        online_shift.main_report,
    ),
}
FOLDERS = {"online_shift_main": "online_shift_offsets"}  # where not results/<name>/
# what a read test prints: a t test, a Holm p, a verdict, a reading of one
TEST_TEXT = re.compile(
    r"\bt [+-]\d+\.\d, p |Holm p (\d|< 0\.001)|no difference shown \(|than the reference \(|"
    r"cost success \(|undecided \(|(raises|lowers) critic EV"
)


def _copy(name: str, tmp: pathlib.Path, drop_one: bool) -> pathlib.Path:
    """The table's runs file (and calibration) in `tmp`; its pre-registration too, with
    one pre-registered run dropped from the runs, when `drop_one`."""
    src = ROOT / "results" / FOLDERS.get(name, name)
    for extra in (CALIBRATION,) + ((audit.PREREGISTRATION,) if drop_one else ()):
        if (src / extra).exists():
            shutil.copy(src / extra, tmp / extra)
    lines = (src / f"{name}{audit.RUNS_SUFFIX}").read_text().splitlines()
    if drop_one:
        prereg = audit.read_preregistration(src, name)
        first = (prereg["rows"][0], prereg["seeds"][0])
        point = lambda line: json.loads(line)["point"]
        lines = [lines[0]] + [
            x for x in lines[1:] if (point(x)["variant"], point(x)["seed"]) != first
        ]
    runs = tmp / f"{name}{audit.RUNS_SUFFIX}"
    runs.write_text("\n".join(lines) + "\n")
    return runs


@pytest.mark.parametrize("state", [PILOT, INCOMPLETE])
@pytest.mark.parametrize("name", list(TABLES))
def test_unread_tables_print_their_status_in_every_test_cell(name, state, tmp_path):
    runs = _copy(name, tmp_path, drop_one=state == INCOMPLETE)
    sweep_of, write = TABLES[name]
    base = Experiment(out_dir=str(tmp_path / "out"))
    exp, text = replay(name, sweep_of, write, str(runs), base)
    assert exp.withheld(audit.read_runs(runs)[0]) == state
    assert f"**{state}**" in text  # the header says it
    assert text.count(f"| {state} |") >= 2  # and the test cells do
    assert not TEST_TEXT.search(text), TEST_TEXT.search(text)
    assert "## Reading (pre-registered)" not in text  # no section headed as a reading


def _section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of its level."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def _replay_shift(folder: str, offsets: str) -> str:
    """The online shift's main table written again in-process from the committed runs file
    in results/<folder>/ (its own pre-registration, or none: a pilot)."""
    sweep_of = lambda mode: shift_cfg.get_sweep(f"table=main,offsets={offsets},mode={mode}")
    runs = ROOT / "results" / folder / f"online_shift_main{audit.RUNS_SUFFIX}"
    base = Experiment(out_dir=None)
    return replay("online_shift_main", sweep_of, online_shift.main_report, str(runs), base)[1]


@pytest.fixture
def _no_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the replays' plots go to tmp_path/results/quick/plots


def test_online_shift_tables_head_each_family_as_what_it_is(_no_writes):
    """A pilot's family is not 'the pre-registered family'; the offsets design's main table
    reads its secondary family from its pre-registration (one test, none missing: no
    'Incomplete' note); a table made under the secondary family's pre-registration prints
    the main table's family as descriptive, with no test, verdict or Holm rule."""
    pilot = _replay_shift("online_shift/pilot", shift_cfg.DEFAULT_OFFSETS)
    assert f"## The main table's family ({PILOT})\n" in pilot
    assert "pre-registered family" not in pilot and "Incomplete:" not in pilot
    assert "counts at Holm" not in pilot and not TEST_TEXT.search(pilot)

    main = _replay_shift("online_shift_offsets", "spread")
    assert "## The pre-registered family\n" in main and "Incomplete:" not in main
    assert TEST_TEXT.search(_section(main, "## Every other row against SAO"))  # read

    second = _replay_shift("online_shift_offsets/secondary", "spread")
    desc = _section(second, "## SAO - the moving average (the main table's family")
    d = online_shift.DESCRIPTIVE
    assert f"| {d} | {d} |" in desc  # its test and verdict cells
    assert not TEST_TEXT.search(desc) and "counts at Holm" not in desc
    ma = next(ln for ln in second.splitlines() if ln.startswith("| moving average, 128"))
    assert f"| {d} |" in ma  # the table of every row says so too
    family = _section(second, "## The pre-registered family (")
    assert TEST_TEXT.search(family) and "counts at Holm p < 0.05" in family
