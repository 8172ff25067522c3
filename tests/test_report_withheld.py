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
