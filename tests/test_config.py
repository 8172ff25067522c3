"""The one default config (sao_jax/defaults.py): configs/base.py is it plus the embedded
model, it validates, and `validate` checks field names and types against it."""

import pathlib
import re
import sys

import numpy as np
import pytest
from sao_jax.configs.models import tiny

from sao_jax import config as config_lib
from sao_jax import defaults
from sao_jax.configs import base
from sao_jax.rl import advantages, losses
from sao_jax.rl.batch import check_divisible
from sao_jax.rl.settings import estimator_params, loss_params
from sao_jax.run import streams
from sao_jax.schema import ConfigError


def test_base_is_the_default_config_with_the_embedded_model():
    got, want = base.get_config().to_dict(), defaults.default_config().to_dict()
    assert got.pop("model") == tiny.get_config().to_dict()
    want.pop("model")
    assert got == want


def test_the_default_config_validates():
    config_lib.validate(defaults.default_config())


def test_reference_leaves_only_the_open_fields_open():
    ref = defaults.reference()
    assert ref["model"] is None and ref["sampling"] is None
    assert ref["env"]["params"] is None and ref["data"]["template_kwargs"] is None
    assert ref["rl"]["batch_size"] == 128 and ref["data"]["fields"]["prompt"] == "prompt"


def test_a_field_the_defaults_lack_is_unknown():
    c = defaults.default_config()
    c.train.nonsense = 1
    with pytest.raises(ConfigError, match=r"config field train.nonsense: unknown field"):
        config_lib.check_fields(c)


def test_one_division_rule_for_validator_run_check_and_batch():
    with pytest.raises(
        ConfigError, match=r"^x: 12 is not divisible by rl.minibatches \(2\) x the "
    ):
        check_divisible(12, "x", minibatches=2, shards=8)
    check_divisible(16, "x", minibatches=2, shards=8)
    c = base.get_config()
    c.rl.update(batch_size=8, minibatches=2, microbatches=3)
    want = r"config field rl.batch_size: 8 is not divisible by rl.minibatches \(2\) x rl.micro"
    with pytest.raises(ConfigError, match=want):
        config_lib.validate(c)


def test_estimator_parameters_are_set_from_the_config_like_loss_parameters():
    c = base.get_config()
    assert c.rl.estimators.to_dict() == {
        name: {"impl": "auto"} for name in ("cross_observation", "gae", "step_last", "step_mean")
    }
    c.rl.estimators.gae.impl = "scan"
    assert estimator_params(c.rl) == {"impl": "scan"}
    config_lib.validate(c)
    c = base.get_config()
    c.rl.estimators.step_last.impl = "loop"
    with pytest.raises(ConfigError, match=r"config field rl.estimators.step_last.impl: must be"):
        config_lib.validate(c)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        (dict(moving_average_keys=5), r"rl.baseline_key: names no prompt meta field"),
        (dict(baseline_key="level"), r"rl.moving_average_keys: must be >= 2 .* got 0"),
        (dict(baseline_key="level", moving_average_keys=5), r"rl.baseline_key: keys the"),
        (dict(advantage="moving_average", moving_average_keys=-1), r"rl.moving_average_keys"),
    ],
)
def test_the_keyed_moving_average_fields_go_together(fields, error):
    c = base.get_config()
    c.rl.update(fields)
    with pytest.raises(ConfigError, match=f"config field {error}"):
        config_lib.validate(c)
    c = base.get_config()
    c.rl.update(advantage="moving_average", baseline_key="level", moving_average_keys=5)
    config_lib.validate(c)


MY_PARTS = """
import jax.numpy as jnp

from sao_jax.rl import advantages, losses


@losses.register("my_dis", {"eps_l": 0.2, "eps_h": 4.0})
def my_dis(x, eps_l, eps_h):
    keep_bt = x.m_bt & (jnp.abs(x.logp_bt - x.rollout_logp_bt) < eps_h)
    return losses.TokenLoss(-jnp.where(keep_bt, x.adv_bt * x.logp_bt, 0.0), keep_bt, {})


@advantages.register("my_baseline", needs_outcome=True, params={"scale": 1.0})
def my_baseline(x, scale):
    a_bt = jnp.where(x.m_bt, x.outcome_b[:, None] * scale, 0.0)
    return advantages.Advantages(a_bt, None, x.baseline_state, {})
"""
MY_CONFIG = """
import my_rl_parts  # noqa: F401 (registers my_dis and my_baseline)

from sao_jax.configs import base


def get_config(arg=None):
    c = base.get_config()
    c.rl.policy_loss = "my_dis"
    c.rl.losses.my_dis.eps_l = 0.1
    c.rl.advantage = "my_baseline"
    c.rl.estimators.my_baseline.scale = 2.0
    return c
"""


def test_a_loss_and_an_estimator_are_one_file_plus_a_config(tmp_path, monkeypatch):
    for registry in (losses.LOSSES, advantages.ESTIMATORS):  # forgotten after the test
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    (tmp_path / "my_rl_parts.py").write_text(MY_PARTS)
    (tmp_path / "mine.py").write_text(MY_CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        c = config_lib.validate(config_lib.load_config(str(tmp_path / "mine.py")))
    finally:
        sys.modules.pop("my_rl_parts", None)
    assert loss_params(c.rl) == {"eps_l": 0.1, "eps_h": 4.0}
    assert estimator_params(c.rl) == {"scale": 2.0}
    m_bt = np.array([[False, True, True]])
    a = advantages.compute_advantages(
        "my_baseline", rewards_bt=None, outcome_b=np.ones(1, np.float32), action_mask_bt=m_bt,
        **estimator_params(c.rl),
    )  # fmt: skip
    np.testing.assert_array_equal(a.advantages_bt, [[0.0, 2.0, 2.0]])
    logp_bt = np.full((1, 3), -1.0, np.float32)
    loss, metrics = losses.policy_loss(
        "my_dis", logp_bt=logp_bt, rollout_logp_bt=logp_bt, advantages_bt=a.advantages_bt,
        action_mask_bt=m_bt, **loss_params(c.rl),
    )  # fmt: skip
    assert float(loss) == 2.0 and float(metrics["keep_rate"][0]) == 2.0


def test_named_streams_derive_the_seeds_every_committed_result_used():
    got = {name: streams.stream_seed(10, name) for name in streams.STREAMS}
    assert got == {
        "model_init": 10, "prompts": 10, "rollouts": 10, "update": 10, "sft_batches": 10,
        "eval": 11, "value_pretrain": 13, "sync_rollouts": 15, "sft_prompts": 17,
        "testbed_probe": 21,
    }  # fmt: skip
    with pytest.raises(KeyError, match="unknown RNG stream 'evl'"):
        streams.stream_seed(0, "evl")


def test_no_seed_offsets_outside_the_streams_table():
    root = pathlib.Path(__file__).resolve().parents[1]
    offset = re.compile(r"seed\s*\+\s*\d|SEED_OFFSET")
    files = [*(root / "sao_jax").rglob("*.py"), *(root / "experiments").glob("*.py")]  # not bench/
    hits = [
        f"{path.relative_to(root)}:{i}"
        for path in sorted(files)
        if path.name != "streams.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if offset.search(line)
    ]
    assert not hits, hits
