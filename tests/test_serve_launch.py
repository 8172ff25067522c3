"""The serve entry's library side (sao_jax/serve/launch.py): configs/harness.py:smoke
served in-process from a fresh workdir (the local tokenizer built, no SFT), gateway.json
written whole once it accepts connections, a call answered, and on stop the live
sessions' episodes written as dropped; init.kind='params' serves a saved warm start."""

import jax
import pytest
from flax import nnx

from sao_jax import checkpointing
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.schema import ConfigError
from sao_jax.serve import launch
from tests.serve_support import calculator_call, episodes, served


def test_serve_harness_smoke(tmp_path):
    config = config_lib.load_config("configs/harness.py:smoke")
    with config.unlocked():
        config.sampling.update(num_slots=2, max_len=512)
    with served(config, tmp_path, timeout=120) as info:
        assert set(info) == {"base_url", "api_key", "port", "model", "pid"}
        assert info["base_url"] == f"http://127.0.0.1:{info['port']}/v1"
        assert (tmp_path / "tokenizer" / "chat_template.jinja").exists()
        r = calculator_call(info)
        assert r.usage.completion_tokens >= 1
    (ep,) = episodes(tmp_path)
    assert ep["dropped"] == "shutdown" and ep["calls"] == 1 and ep["reward"] is None


def test_params_init_serves_the_saved_warm_start(tmp_path):
    """init.kind='params': the policy a run saved as its warm start (train.py
    `save_policy`), restored bit for bit; a missing folder is named."""
    config = config_lib.load_config("configs/harness.py:smoke")
    sharder = Sharder()
    cfg = ModelConfig.from_config(config.model)
    _, saved = init_params(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(7)), sharder)
    with checkpointing.Checkpointer(tmp_path / "warm", keep=1, async_save=False) as c:
        c.save(0, saved, {"model": config.model.to_dict()})
    with config.unlocked():
        config.init.update(kind="params", params_path=str(tmp_path / "warm"))
    _, got = launch._policy(config, sharder)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), got, saved))
    with config.unlocked():
        config.init.params_path = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="init.params_path"):
        launch._policy(config, sharder)
