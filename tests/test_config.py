"""The one default config (sao_jax/defaults.py): configs/base.py is it plus the embedded
model, it validates, and `validate` checks field names and types against it."""

import pytest
from sao_jax.configs.models import tiny

from sao_jax import config as config_lib
from sao_jax import defaults
from sao_jax.configs import base
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
