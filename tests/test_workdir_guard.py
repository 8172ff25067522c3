"""The workdir config guard (checkpointing/workdir.py) and GracefulExit (signals.py)."""

import json
import logging
import os
import signal
import time

import pytest

from configs import base
from sao_jax import checkpointing as ckpt
from sao_jax import stop as stop_flag
from sao_jax.schema import ConfigError

# ------------------------------------------------------------------ workdir config guard


def test_workdir_config_guard(tmp_path):
    cfg = base.get_config().to_dict()  # tuples, placeholders (None), nested sections
    wd = tmp_path / "run"
    ckpt.check_workdir_config(wd, cfg, overwrite=False)  # first run writes it
    stored = json.loads((wd / ckpt.CONFIG_FILE).read_text())
    assert stored["mesh"]["shape"] == list(cfg["mesh"]["shape"])
    ckpt.check_workdir_config(wd, cfg, overwrite=False)  # same config: resume

    longer = json.loads(json.dumps(stored))
    longer["train"]["total_steps"] += 100
    longer["mesh"]["shape"] = [1, 1, 8, 1]
    ckpt.check_workdir_config(wd, longer, overwrite=False)  # resumable fields only
    assert json.loads((wd / ckpt.CONFIG_FILE).read_text()) == longer

    (wd / "checkpoints" / "3").mkdir(parents=True)  # a committed step: a run to resume
    changed = json.loads(json.dumps(longer))
    changed["rl"]["k_critic"] += 1
    changed["optim"]["policy"]["lr"] *= 2
    with pytest.raises(ConfigError, match=r"config field optim\.policy\.lr: .*\(2 non-resumable"):
        ckpt.check_workdir_config(wd, changed, overwrite=False)
    changed["new_section"] = {"x": 1}
    with pytest.raises(ConfigError, match=r"new_section\.x: the run .* used '\(absent\)'"):
        ckpt.check_workdir_config(wd, changed, overwrite=False)

    ckpt.check_workdir_config(wd, changed, overwrite=True)  # old run moved aside
    (old,) = [p for p in wd.iterdir() if p.name.startswith("previous-")]
    assert (old / "checkpoints" / "3").is_dir() and (old / ckpt.CONFIG_FILE).exists()
    assert not (wd / "checkpoints").exists()
    assert json.loads((wd / ckpt.CONFIG_FILE).read_text()) == changed


def test_workdir_without_a_checkpoint_takes_a_corrected_config(tmp_path, caplog):
    wd = tmp_path / "run"
    ckpt.check_workdir_config(wd, {"rl": {"k": 1}}, overwrite=False)
    (wd / "metrics.jsonl").write_text("{}\n")  # the run failed before its first checkpoint
    (wd / "checkpoints" / "0.orbax-checkpoint-tmp").mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        ckpt.check_workdir_config(wd, {"rl": {"k": 2}}, overwrite=False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "has no checkpoint" in line and "rl.k" in line
    assert json.loads((wd / ckpt.CONFIG_FILE).read_text()) == {"rl": {"k": 2}}
    (old,) = wd.glob("previous-*")
    assert (old / "metrics.jsonl").exists() and not (wd / "metrics.jsonl").exists()


def test_workdir_with_files_but_no_config_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        ckpt.check_workdir_config(tmp_path, {"a": 1}, overwrite=False)
    with pytest.raises(TypeError, match=r"config\['a'\]: object"):
        ckpt.check_workdir_config(tmp_path / "x", {"a": object()}, overwrite=False)


# ----------------------------------------------------------------------- GracefulExit


def _wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


def test_graceful_exit_on_sigterm_and_second_sigint():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with ckpt.GracefulExit() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: stop.requested)
        assert stop.requested and stop.signal == signal.SIGTERM  # and we are still alive
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(lambda: False, timeout=2.0)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert not stop_flag.requested()  # the process-wide flag is cleared on leaving


def test_a_field_added_since_the_run_at_its_default_does_not_block_resume(tmp_path, caplog):
    wd = tmp_path / "run"
    ckpt.check_workdir_config(wd, {"rl": {"k": 1}}, overwrite=False)  # an older sao_jax's file
    (wd / "checkpoints" / "3").mkdir(parents=True)
    defaults = {"rl": {"k": 2, "target": "lambda"}}
    newer = {"rl": {"k": 1, "target": "lambda"}}  # rl.target added later, at its default
    with caplog.at_level(logging.INFO):
        ckpt.check_workdir_config(wd, newer, overwrite=False, defaults=defaults)
    assert any("rl.target" in r.getMessage() for r in caplog.records)
    assert json.loads((wd / ckpt.CONFIG_FILE).read_text()) == newer  # recorded from now on
    (wd / ckpt.CONFIG_FILE).write_text(json.dumps({"rl": {"k": 1}}))
    want = "config field rl.target: .*absent: default 'lambda'.* 'brace'"
    with pytest.raises(ConfigError, match=want):
        ckpt.check_workdir_config(
            wd, {"rl": {"k": 1, "target": "brace"}}, overwrite=False, defaults=defaults
        )
    with pytest.raises(ConfigError, match="config field rl.target"):  # no defaults: absent
        ckpt.check_workdir_config(wd, newer, overwrite=False)
