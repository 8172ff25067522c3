"""The one default config (sao_jax/defaults.py): configs/base.py is it plus the embedded
model, it validates, and `validate` checks field names and types against it."""

import pytest
from sao_jax.configs.models import tiny

from sao_jax import config as config_lib
from sao_jax import defaults
from sao_jax.configs import base
from sao_jax.rl.batch import check_divisible
from sao_jax.rl.settings import estimator_params
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
