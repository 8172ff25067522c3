"""Score finished runs' checkpoints again on a larger held-out set (evaluation only).

    rescorer = Rescorer(heldout=2048)        # engines compiled once, reused across runs
    rescorer("workdirs/sweeps/full/ablations__sao__seed=0", step=60)["eval/sampled_success"]

A run's own evaluation scores `env.eval_size` held-out prompts (512 in the full tables), a
binomial SE of ~2 points per score at 40% success. Rescoring the checkpoint of `step`
(None: the newest) on `heldout` prompts of the same held-out split takes that measurement
noise down without training anything again. What a run is scored on is what its own
evaluation uses, from the run's config.json: the held-out split of `env` for the run's
seed (`heldout` prompts instead of `env.eval_size`; the first ones are the run's own), the
sampling settings of `sampling`, the sampling key of the seed's 'eval' stream
(sao_jax/run/streams.py), folded with the step, as `sao_jax/train.py` does. Runs of one
seed (the rows of a table) therefore see the same prompts and keys: their differences
stay paired (common random numbers).
Engines are compiled once per model / sampling / task and reused across seeds.
"""

from __future__ import annotations

import json
import logging
import pathlib

from sao_jax import export
from sao_jax.models.factory import policy_def
from sao_jax.parallel import distributed
from sao_jax.parallel.mesh import Sharder
from sao_jax.run.evaluation import Evaluator
from sao_jax.run.inputs import read_inputs
from sao_jax.run.streams import stream_seed
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.schema import ConfigDict, ConfigError

log = logging.getLogger("sao_jax")


def _engine_key(config: ConfigDict) -> str:
    """What the compiled evaluation engines depend on: the model, sampling and task
    settings and the tokenizer (not the seed, the held-out size, the group size of
    training, or anything RL trains)."""
    env = {k: v for k, v in config.env.to_dict().items() if k not in ("eval_size", "group_size")}
    init = {k: v for k, v in config.init.to_dict().items() if not k.endswith("_path")}
    parts = dict(
        model=config.model.to_dict(),
        sampling=config.sampling.to_dict(),
        env=env,
        init=dict(init, hf_path=config.init.hf_path),  # tokenizer, chat template, shapes
        data=config.data.to_dict(),
    )
    return json.dumps(parts, sort_keys=True, default=str)


def heldout_config(config: ConfigDict, heldout: int) -> ConfigDict:
    """The run's config with `heldout` held-out prompts."""
    if heldout < 1:
        raise ConfigError(f"heldout: need at least one held-out prompt, got {heldout}")
    out = ConfigDict(config.to_dict())
    out.env.eval_size = heldout
    return out


class Rescorer:
    """Evaluators built once per engine key; `__call__(workdir)` scores one run."""

    def __init__(self, heldout: int, *, greedy: bool = True):
        self.heldout, self.greedy = heldout, greedy
        self._evaluators: dict[str, Evaluator] = {}

    def _evaluator(self, config: ConfigDict, workdir: pathlib.Path) -> Evaluator:
        cfg = heldout_config(config, self.heldout)
        inputs = read_inputs(cfg)  # the seed's held-out prompts (ConfigError names a field)
        seed = stream_seed(cfg.seed, "eval")
        key = _engine_key(cfg)
        if key in self._evaluators:
            return self._evaluators[key].for_prompts(inputs.eval_prompts, seed=seed)
        mcfg = export.model_config(cfg, workdir)
        engine_cfg, sampler_cfg = configs_from_section(
            cfg.sampling, stream_seed(cfg.seed, "rollouts")
        )
        evaluator = Evaluator(
            policy_def(mcfg, Sharder()),
            inputs.tokenizer,
            inputs.env_factory,
            inputs.eval_prompts,
            engine_cfg,
            sampled=True,
            greedy=self.greedy,
            seed=seed,
            max_env_errors=sampler_cfg.max_env_errors,
        )
        self._evaluators[key] = evaluator
        return evaluator

    def __call__(self, workdir: str | pathlib.Path, step: int | None = None) -> dict[str, float]:
        """`eval/...` metrics of the run's checkpoint `step` (None: the newest) on
        `heldout` prompts, with `eval/step` (the checkpoint's step) and `eval/heldout`."""
        workdir = pathlib.Path(workdir)
        config = export.run_config(workdir)
        policy, step, mcfg = export.restore_policy(workdir, config, step)
        params = distributed.host_local(policy, dtype=mcfg.compute_dtype)
        out = self._evaluator(config, workdir)(params, step, step=step)
        out.update({"eval/step": float(step), "eval/heldout": float(self.heldout)})
        log.info("rescored %s at step %d on %d prompts", workdir, step, self.heldout)
        return out
