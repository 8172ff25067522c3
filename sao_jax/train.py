"""The main job: warm start -> value pretraining -> asynchronous RL -> evaluation -> report.

`run(config, workdir)` is everything `python -m experiments.train` does. Before anything
compiles or touches the workdir, the config is checked once: field names, types and ranges
(`sao_jax.config.validate`), then paths and batch sizes against the mesh
(`sao_jax.run_settings.check_run`). Resume order
(docs/checkpointing.md): config check against the workdir -> models and learner ->
restore the TrainState -> restore the prompt iterator and counters -> republish the
policy to the sampler. SIGTERM / SIGINT: finish the current update, save, exit 0; every
wait (rollouts, env calls) polls the stop flag (sao_jax/stop.py), so a run blocked on a
hanging environment stops within seconds too. With several processes the stop decision
is agreed once per step (`distributed.agree_stop`), so all save the same step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import platform
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from sao_jax import checkpointing, metrics, report, stop
from sao_jax import config as config_lib
from sao_jax.chat_template import run_chat_format
from sao_jax.data.pipeline import run_prompts
from sao_jax.data.prompts import prompt_iterator
from sao_jax.envs.registry import env_factory
from sao_jax.evaluation import Evaluator
from sao_jax.models import hf
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import Models, init_models
from sao_jax.models.transformer import Policy, critic_params_from_policy
from sao_jax.parallel import distributed
from sao_jax.parallel.mesh import Sharder, sharder_from_config
from sao_jax.parallel.partition import ModelDef
from sao_jax.progress import Progress
from sao_jax.rl.update import Learner
from sao_jax.rollouts import AsyncRollouts, SyncRollouts
from sao_jax.run_settings import check_run
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.sampling.trajectory import Trajectory, pack_batch, pad_batch, round_up
from sao_jax.schema import ConfigDict, ConfigError
from sao_jax.sft import SFTTrainer, demo_batches
from sao_jax.tokenizer import load_tokenizer

log = logging.getLogger("sao_jax")


def _models(config: ConfigDict, sharder, tokenizer) -> Models:
    if config.init.kind == "hf":
        cfg, pdef, policy = hf.load_hf_policy(config.init.hf_path, sharder=sharder)
        _, cdef, critic = hf.load_hf_critic(config.init.hf_path, sharder=sharder)
        models = Models(cfg, pdef, policy, cdef, critic)
    else:
        models = init_models(ModelConfig.from_config(config.model), sharder, config.seed)
    if tokenizer.vocab_size > models.cfg.vocab_size:
        raise ConfigError(
            f"config field model.vocab_size: {models.cfg.vocab_size} < the tokenizer's "
            f"{tokenizer.vocab_size} tokens"
        )
    return models


def _host_stats(trajs: list[Trajectory], version: int) -> dict[str, float]:
    lags = np.concatenate([version - t.versions[t.action_mask] for t in trajs])
    return {
        "train/reward": float(np.mean([t.outcome for t in trajs])),
        "train/success": float(np.mean([bool(t.info.get("success", False)) for t in trajs])),
        "train/truncated": float(np.mean([t.truncated for t in trajs])),
        "train/action_tokens": float(np.mean([t.num_actions for t in trajs])),
        "train/staleness": float(np.mean(lags)),
        "train/max_staleness": float(np.max(lags)),
    }


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What a run reads besides the model: tokenizer, chat template, envs, prompts."""

    tokenizer: Any
    chat: Any  # a ChatFormat, or None for raw text
    env_factory: Any
    set_env_step: Any  # the task's step hook, or None
    train_prompts: Any  # grain.MapDataset, endless
    eval_prompts: list


def read_inputs(config: ConfigDict) -> Inputs:
    """Every input file read and checked (tokenizer, chat template, dataset rows, env
    parameters and reward), before the workdir is touched; ConfigError naming the field."""
    try:
        tokenizer = load_tokenizer(config.init.tokenizer)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config field init.tokenizer: {e}") from None
    chat = run_chat_format(config, tokenizer)
    env = config.env
    try:
        factory, hook = env_factory(env.name, env.params.to_dict(), chat)
    except ConfigError:
        raise
    except ValueError as e:  # unknown reward, bad env parameter, bad chat rendering
        raise ConfigError(f"config field env.params: {e}") from None
    train_prompts, eval_prompts = run_prompts(config)  # task generator or dataset
    try:  # the chat template renders, the env takes the prompts
        factory().reset(eval_prompts[0])
    except ValueError as e:
        raise ConfigError(
            f"config field env.name: task {env.name!r} refuses the first held-out prompt "
            f"{eval_prompts[0].uid!r}: {e}"
        ) from None
    return Inputs(tokenizer, chat, factory, hook, train_prompts, eval_prompts)


class Run:
    """One training run's objects; `run()` below drives them."""

    def __init__(
        self,
        config: ConfigDict,
        workdir: pathlib.Path,
        sharder: Sharder | None = None,
        inputs: Inputs | None = None,
    ):
        inputs = inputs or read_inputs(config)
        self.config = config
        self.workdir = workdir
        self.sharder = sharder or sharder_from_config(config)
        self.tokenizer = inputs.tokenizer
        self.models = _models(config, self.sharder, self.tokenizer)
        self.learner = Learner(config, self.models.policy_def, self.models.critic_def, self.sharder)
        # Several processes (docs/scaling.md): each host's sampler makes B / P trajectories
        # with a host-local policy copy (a model without global-mesh constraints).
        self.local_batch = distributed.local_batch_size(config.rl.batch_size)
        if config.train.pack and jax.process_count() > 1:
            raise ConfigError(
                "config field train.pack: packing is single-process for now (hosts would "
                "bring different numbers of packed rows); set train.pack=False"
            )
        self.batch_sharding = self.sharder.named(("batch",))
        self.sampler_def = self.models.policy_def
        if jax.process_count() > 1:
            self.sampler_def = ModelDef.of(lambda: Policy(self.models.cfg, rngs=nnx.Rngs(0)))
        self.engine_cfg, self.sampler_cfg = configs_from_section(config.sampling, config.seed)
        self.chat = inputs.chat  # None: raw text prompts
        # The bounds of every rollouts take (RL loop and value pretraining): docs/checkpointing.md
        self.take_bounds = dict(
            take_timeout_s=config.train.take_timeout_s,
            max_env_errors=self.sampler_cfg.max_env_errors,
        )
        self.env_factory, self.set_env_step = inputs.env_factory, inputs.set_env_step
        eval_prompts = inputs.eval_prompts
        self.prompts = iter(distributed.process_shard(inputs.train_prompts).to_iter_dataset())
        self.evaluator = Evaluator(
            self.sampler_def,
            self.tokenizer,
            self.env_factory,
            eval_prompts,
            self.engine_cfg,
            sampled=config.train.eval_sampled,
            seed=config.seed + 1,
        )
        t = config.train
        self.ckpt = checkpointing.Checkpointer(
            workdir / "checkpoints", keep=t.keep_checkpoints, async_save=t.async_checkpoints
        )
        self.writer = None  # created once the resume step is known
        self.key = jax.random.key(config.seed)
        vp = config.value_pretrain.steps
        self.pre_updates = vp if (self.learner.uses_critic and vp > 0) else 0

    # ------------------------------------------------------------------------ stages

    def warm_start(self):
        """Stage (a): SFT on demonstrations, a HF checkpoint, or the random init."""
        cfg, models = self.config, self.models
        policy = models.policy
        if cfg.init.kind == "params":
            policy = self.load_policy(cfg.init.params_path)
        if cfg.init.kind == "sft" and cfg.sft.steps > 0:
            demo_prompts = prompt_iterator(
                cfg.env.name,
                "train",
                seed=cfg.seed + 7,
                eval_fraction=cfg.env.eval_fraction,
                **cfg.env.prompts,
            )
            batches = demo_batches(
                cfg.env.name,
                demo_prompts,
                self.tokenizer,
                batch_size=cfg.sft.batch_size,
                length=cfg.sft.length,
                error_rate=cfg.sft.error_rate,
                seed=cfg.seed,
                add_bos=self.engine_cfg.add_bos,
            )
            batches = (distributed.global_from_replicated(x, self.batch_sharding) for x in batches)
            batches = _stoppable(batches, "warm start (SFT)")
            trainer = SFTTrainer(models.policy_def, cfg.sft.optim, self.sharder)
            log.info("warm start: %d SFT steps on demonstrations", cfg.sft.steps)
            policy = trainer.run(
                policy,
                batches,
                cfg.sft.steps,
                on_log=lambda s, m: log.info("sft step %d: %s", s, _fmt(m)),
            )
            self.save_policy(self.workdir / "warm_start", policy)
        critic = critic_params_from_policy(policy, models.critic)
        return self.learner.new_state(policy, critic, cfg.seed)

    def save_policy(self, path: pathlib.Path, policy) -> None:
        """Writes the warm-start policy, reusable by other runs (init.kind='params')."""
        with checkpointing.Checkpointer(path, keep=1, async_save=False) as c:
            c.save(0, policy, {"model": self.config.model.to_dict()})

    def load_policy(self, path: str):
        pdef = self.models.policy_def
        if not pathlib.Path(path).is_dir():
            raise ConfigError(f"config field init.params_path: {path!r} is not a directory")
        with checkpointing.Checkpointer(path, keep=1, async_save=False) as c:
            policy, _ = c.restore(
                checkpointing.abstract_like(pdef.shapes(), pdef.shardings(self.sharder))
            )
        log.info("warm start: policy params from %s", path)
        return policy

    def value_pretrain(self, state):
        """Stage (b): critic-only steps on Monte-Carlo returns of the fixed initial policy."""
        vp, b = self.config.value_pretrain, self.local_batch
        if not (self.learner.uses_critic and vp.steps > 0):
            return state
        source = SyncRollouts(
            self.sampler_def,
            self.tokenizer,
            self.env_factory,
            self.prompts,
            self.engine_cfg,
            seed=self.config.seed + 3,
            **self.take_bounds,
        )
        source.publish(self.sampler_params(state.policy), int(state.step))
        trajs = source.take(vp.rollouts)
        log.info("value pretraining: %d steps on %d rollouts", vp.steps, len(trajs))
        acc = metrics.MetricAccumulator()
        for i in range(vp.steps):
            chunk = [trajs[(i * b + j) % len(trajs)] for j in range(b)]
            batch = self._batch(chunk)
            state, m = self.learner.value_step(state, batch, self._key(state))
            acc.add(m)
        result = acc.result()
        log.info("value pretraining done: %s", _fmt(result, "critic/"))
        self.learner.raise_if_diverged(state)
        return state

    def _batch(self, trajs: list[Trajectory]) -> dict[str, Any]:
        cfg = self.config
        length = None
        if jax.process_count() > 1:  # all hosts pad to the longest row of the global batch
            longest = distributed.agree_max(max(t.length for t in trajs))
            length = round_up(longest, cfg.train.length_bucket)
        kw = dict(
            length=length,
            length_bucket=cfg.train.length_bucket,
            with_groups=self.learner.estimator.needs_groups,
            with_routing=cfg.rl.routing_replay,
        )
        if cfg.train.pack:  # model passes on packed rows (sao_jax/rl/packing.py)
            batch, _ = pack_batch(
                trajs,
                row_length=cfg.train.pack_length or None,
                microbatches=cfg.rl.microbatches,
                shards=self.sharder.axis_size("batch"),
                rows_multiple=cfg.train.pack_rows_multiple,
                **kw,
            )
        else:
            batch = pad_batch(trajs, **kw)
        batch = distributed.global_batch(batch, self.batch_sharding)
        self.learner.check_batch(batch)
        return batch

    def sampler_params(self, policy):
        """The params samplers and evaluation run on: the policy in the compute dtype
        (every weight is cast to it at use anyway, so rollouts are unchanged and a bf16
        copy takes half the memory), as this host's own copy with several processes."""
        return distributed.host_local(policy, dtype=self.models.cfg.compute_dtype)

    def _key(self, state):
        return jax.random.fold_in(self.key, int(state.updates))

    def rollouts(self):
        cfg = self.config
        kw = dict(group_size=cfg.env.group_size)
        args = (self.sampler_def, self.tokenizer, self.env_factory, self.prompts)
        if cfg.train.rollouts == "sync":
            return SyncRollouts(*args, self.engine_cfg, seed=cfg.seed + 5, **kw, **self.take_bounds)
        timeout = self.take_bounds["take_timeout_s"]
        return AsyncRollouts(*args, self.engine_cfg, self.sampler_cfg, take_timeout_s=timeout, **kw)

    def evaluate(self, state, step: int) -> dict[str, float]:
        t0 = time.time()
        out = self.evaluator(self.sampler_params(state.policy), int(state.step), step=step)
        out["eval/seconds"] = time.time() - t0
        self.writer.write_scalars(step, out)
        log.info("eval at step %d: %s", step, _fmt(out, "eval/"))
        return out

    def save(self, step: int, state, source, counters: dict, extra: dict) -> None:
        meta = dict(
            prompts=source.prompt_state() if source is not None else self.prompts.get_state(),
            counters=counters,
            before=extra["before"],
            wall_time=_wall(extra),
        )
        self.ckpt.save(step, state, meta)


def _stoppable(items, what: str):
    """`items`, raising StopRequested at the next item once a stop was requested."""
    for item in items:
        stop.raise_if_requested(what)
        yield item


def _fmt(m: dict[str, float], prefix: str = "") -> str:
    items = [(k.removeprefix(prefix), v) for k, v in m.items() if k.startswith(prefix)]
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(items))


def run(config: ConfigDict, workdir: str | pathlib.Path, *, overwrite: bool = False) -> dict:
    """Runs (or resumes) one training run in `workdir`; returns the summary dict."""
    config = config_lib.validate(config)
    sharder = sharder_from_config(config)
    check_run(config, sharder)
    inputs = read_inputs(config)  # a bad input file stops here, before the workdir exists
    workdir = pathlib.Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"flag --workdir: {workdir} exists and is not a directory")
    workdir.mkdir(parents=True, exist_ok=True)
    checkpointing.check_workdir_config(workdir, config.to_dict(), overwrite=overwrite)
    t_start = time.time()
    r = Run(config, workdir, sharder, inputs)
    t = config.train
    with checkpointing.GracefulExit() as stopper:
        latest = r.ckpt.latest_step()
        if latest is None:
            r.writer = metrics.create_writers(workdir, resume_step=-1)
            try:
                state = r.warm_start()
                before = r.evaluate(state, 0)
                state = r.value_pretrain(state)
            except stop.StopRequested as e:  # nothing resumable yet: the next run starts over
                log.warning("%s, before the first checkpoint: exiting without one", e)
                return _close(r, workdir, t, dict(steps=0, interrupted=True, before={}))
            extra = dict(before=before, prior_wall_time=0.0, t_start=t_start)
            counters = _resume_counters({})
            r.save(0, state, None, _counters(counters, {}), extra)
        else:
            abstract = checkpointing.abstract_like(
                r.learner.abstract_state, r.learner.state_shardings
            )
            state, meta = r.ckpt.restore(abstract)
            r.prompts.set_state(meta["prompts"])
            r.writer = metrics.create_writers(workdir, resume_step=int(state.step))
            extra = dict(before=meta["before"], prior_wall_time=meta["wall_time"], t_start=t_start)
            counters = _resume_counters(meta.get("counters", {}))
            log.info("resumed from step %d (checkpoint %d)", int(state.step), latest)
        summary = _rl(r, state, counters, extra, stopper, t_start)
    return _close(r, workdir, t, summary)


def _close(r: Run, workdir: pathlib.Path, t, summary: dict) -> dict:
    r.ckpt.wait()
    r.ckpt.close()
    r.writer.close()
    if t.report and distributed.is_primary() and summary.get("steps"):
        report.write_report(workdir, summary=summary)
    text = json.dumps(_finite(summary), indent=2, sort_keys=True, allow_nan=False)
    if distributed.is_primary():
        (workdir / "summary.json").write_text(text)
    return summary


def _rl(r: Run, state, counters: dict, extra: dict, stopper, t_start: float) -> dict:
    """Stage (c) + (d): the asynchronous RL loop with periodic evaluation and saves.

    The stop decision is taken at one point per step, after the take: this process wants
    to stop (a signal, or a take interrupted by it), agreed across processes
    (`agree_stop`); then every process leaves the loop before the next collective, and
    saves the same step."""
    cfg, learner = r.config, r.learner
    t = cfg.train
    b = r.local_batch  # this host's share of the batch
    source = r.rollouts()
    if r.set_env_step is not None:
        r.set_env_step(int(state.step))
    source.publish(r.sampler_params(state.policy), int(state.step))
    source.start()
    acc = metrics.MetricAccumulator()
    host: list[dict[str, float]] = []
    start = min(int(state.step), t.total_steps)
    progress = Progress(t.total_steps, initial=start, enabled=t.progress)
    tokens, t_log = 0, time.time()
    last = {}
    stopped = False
    try:
        while int(state.step) < t.total_steps:
            trajs = take_or_stop(source, b, t.take_timeout_s, stopper)
            if trajs is None:
                stopped = True
                break
            batch = r._batch(trajs)
            version = int(state.step)
            host.append(_host_stats(trajs, version))
            tokens += int(batch["action_mask"].sum())
            if int(state.updates) < r.pre_updates + cfg.rl.critic_only_steps:
                state, m = learner.value_step(state, batch, r._key(state))  # critic warm-up
                acc.add(m)
                continue
            state, m = learner.update_step(state, batch, r._key(state))
            source.publish(r.sampler_params(state.policy), int(state.step))
            if r.set_env_step is not None:  # non-stationary tasks follow the policy step
                r.set_env_step(int(state.step))
            acc.add(m)
            step = int(state.step)
            if step % t.log_every == 0 or step == t.total_steps:
                learner.raise_if_diverged(state)
                now = time.time()
                scalars = {**acc.result(), **_mean(host)}
                scalars["perf/action_tokens_per_s"] = tokens / max(now - t_log, 1e-9)
                scalars["train/skipped_steps"] = float(state.skipped_steps)
                scalars.update(_sampler_scalars(source.stats(), counters))
                r.writer.write_scalars(step, scalars)
                progress.update(step, scalars)
                last = scalars
                acc, host, tokens, t_log = metrics.MetricAccumulator(), [], 0, now
            if t.eval_every and step % t.eval_every == 0 and step < t.total_steps:
                _unless_stopped(r.evaluate, state, step)
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.total_steps:
                r.save(step, state, source, _counters(counters, source.stats()), extra)
    finally:
        source.stop()
        progress.close()
    step = int(state.step)
    after = {}
    if step >= t.total_steps and not stopped:
        after = _unless_stopped(r.evaluate, state, step) or {}
    r.save(step, state, source, _counters(counters, source.stats()), extra)
    return dict(
        steps=step,
        before=extra["before"],
        after=after,
        last_train=last,
        counters=_counters(counters, source.stats()),
        staleness_hist=source.stats().get("staleness", {}),
        wall_time_s=_wall(extra),
        machine=_machine(),
        interrupted=bool(stopped or stopper.requested),
    )


def take_or_stop(source, n: int, timeout: float, stopper) -> list[Trajectory] | None:
    """This step's n trajectories, or None when any process stops: this one was signalled
    (before or during the take), or another one was. Collective (`agree_stop`): every
    process calls it once per step, before the step's first collective."""
    trajs = None
    if not stopper.requested:
        try:
            trajs = source.take(n, timeout)
        except stop.StopRequested as e:
            log.warning("%s", e)
    return None if distributed.agree_stop(trajs is None) else trajs


def _unless_stopped(fn, *args):
    """fn(*args), or None when a stop request interrupted it (host-local work only: the
    decision to stop is agreed at the top of the next step)."""
    try:
        return fn(*args)
    except stop.StopRequested as e:
        log.warning("%s: skipped", e)
        return None


def _wall(extra: dict) -> float:
    """Wall time of the whole run: earlier segments (before a resume) + this one."""
    return extra["prior_wall_time"] + time.time() - extra["t_start"]


def _machine() -> str:
    dev = jax.devices()[0]
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{jax.device_count()} x {dev.platform} ({dev.device_kind})"
    )


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    if not rows:
        return {}
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _sampler_scalars(stats: dict[str, Any], base: dict) -> dict[str, float]:
    """The sampler's gauges (queued, version, ...); generated / taken / dropped are run
    totals (earlier segments included), so a resumed run continues the curves."""
    out = {f"sampler/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))}
    totals = _counters(base, stats)
    out["sampler/generated"] = float(totals["generated"])
    out["sampler/taken"] = float(totals["trained"])
    out["sampler/dropped"] = float(totals["dropped_stale"] + totals["dropped_episodes"])
    return out


def _finite(x: Any) -> Any:
    """`x` with non-finite floats replaced by None (strict JSON, as in metrics.jsonl)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _resume_counters(saved: dict) -> dict:
    """Totals of earlier run segments; what was in flight at their save is discarded."""
    keys = ("generated", "trained", "dropped_stale", "dropped_episodes", "discarded")
    base = {k: int(saved.get(k, 0)) for k in keys}
    base["discarded"] += int(saved.get("in_flight", 0))
    return base


def _counters(base: dict, stats: dict[str, Any]) -> dict:
    """Trajectory counters since the run began (`base`: earlier segments, `stats`: the
    source's). Balance, checked by the tests: generated == trained + dropped_stale +
    discarded + in_flight (finished, not yet trained); dropped_episodes never finished
    (env errors, prompts too long, ...)."""
    dropped = dict(stats.get("dropped", {}))
    stale = int(dropped.pop("stale", 0))
    out = {
        "generated": base["generated"] + int(stats.get("generated", 0)),
        "trained": base["trained"] + int(stats.get("taken", 0)),
        "dropped_stale": base["dropped_stale"] + stale,
        "dropped_episodes": base["dropped_episodes"] + int(sum(dropped.values())),
        "discarded": base["discarded"],
        "in_flight": int(stats.get("queued", 0)) + int(stats.get("in_open_groups", 0)),
    }
    return out
