"""The main job: warm start -> value pretraining -> asynchronous RL -> evaluation -> report.

Value pretraining (sao_jax/run/value_pretrain.py) runs once, before checkpoint 0, on its own
prompt stream; the pretrained critic is saved to <workdir>/warm_start_critic, which other
runs can start from (init.critic_path; sweeps share it per seed). A SIGTERM during it
leaves no checkpoint: the rerun starts the run again.

`run(config, workdir)` is everything `python -m experiments.train` does. Before anything
compiles or touches the workdir, the config is checked once: field names, types and ranges
(`sao_jax.config.validate`), then paths and batch sizes against the mesh
(`sao_jax.run.settings.check_run`), then, with the config as run (`resolved_config`: an
HF init's model and tokenizer are the checkpoint's), against the real inputs: prompt
lengths, vocabulary, tools (`sao_jax.run.preflight`). A finished run is not run again
(one line; a larger train.total_steps continues it). Resume order
(docs/checkpointing.md): config check against the workdir -> models and learner ->
restore the TrainState -> restore the prompt iterator and counters -> republish the
policy to the sampler. With `gateway.mode` 'harness' or 'live' the trajectories come
from agent harnesses' episodes through the rollout gateway (sao_jax/serve/source.py,
docs/harness.md), into the same loop. SIGTERM / SIGINT: finish the current update, save,
exit 0; every wait (rollouts, env calls) polls the stop flag (sao_jax/stop.py), so a run
blocked on a hanging environment stops within seconds too. With several processes the
stop decision is agreed once per step (`distributed.agree_stop`), so all save the same
step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pathlib
import time
from typing import Any

import jax
from flax import nnx

from sao_jax import checkpointing, metrics, stop
from sao_jax import config as config_lib
from sao_jax.data.pipeline import run_prompts
from sao_jax.data.prompts import prompt_iterator
from sao_jax.defaults import default_config
from sao_jax.envs.registry import PRETRAIN_STEP
from sao_jax.models.transformer import Policy, critic_params_from_policy
from sao_jax.parallel import distributed
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef
from sao_jax.parallel.placement import Placement, placement_from_config, trainer_sharder
from sao_jax.parallel.reshard import cast_and_reshard
from sao_jax.report.progress import Progress
from sao_jax.report.samples import SampleWriter
from sao_jax.report.startup import startup_lines
from sao_jax.rl.update import Learner
from sao_jax.run import accounting as acct
from sao_jax.run import preflight, token_dump, value_pretrain
from sao_jax.run.evaluation import Evaluator
from sao_jax.run.inputs import Inputs, build_models, load_policy, read_inputs, resolved_config
from sao_jax.run.settings import check_run
from sao_jax.run.sft import SFTTrainer, demo_batches
from sao_jax.run.streams import stream_seed
from sao_jax.sampling.backend import engine_died
from sao_jax.sampling.backend_factory import run_backend
from sao_jax.sampling.engine import generate_fns
from sao_jax.sampling.rollouts import AsyncRollouts, SyncRollouts
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.sampling.trajectory import (
    Trajectory,
    pack_batch,
    pad_batch,
    privileged_tokens,
    round_up,
)
from sao_jax.schema import ConfigDict, ConfigError

log = logging.getLogger("sao_jax")


class Run:
    """One training run's objects; `run()` below drives them."""

    def __init__(
        self,
        config: ConfigDict,
        workdir: pathlib.Path,
        sharder: Sharder | None = None,
        inputs: Inputs | None = None,
        placement: Placement | None = None,
    ):
        inputs = inputs or read_inputs(config)
        self.config = config
        self.workdir = workdir
        # Where the sampler pool runs (sao_jax/parallel/placement.py); the trainer mesh
        # takes the devices it leaves.
        self.placement = placement or placement_from_config(config)
        self.sharder = sharder or trainer_sharder(config, self.placement)
        self.tokenizer = inputs.tokenizer
        self.models = build_models(config, self.sharder, self.tokenizer)
        self.learner = Learner(
            config.rl, config.optim, self.models.policy_def, self.models.critic_def, self.sharder
        )
        # Several processes (docs/scaling.md): each host's sampler makes B / P trajectories
        # with a host-local policy copy (a model without global-mesh constraints).
        self.local_batch = distributed.local_batch_size(config.rl.batch_size)
        if config.train.pack and jax.process_count() > 1:
            raise ConfigError(
                "config field train.pack: packing is single-process for now (hosts would "
                "bring different numbers of packed rows); set train.pack=False"
            )
        self.batch_sharding = self.sharder.named(("batch",))
        # Samplers decode without the trainer mesh's constraints: on the pool's own mesh
        # (disaggregated) or unconstrained (per-host samplers of several processes).
        pool = self.placement.pool_sharder(config.mesh.rules)
        self.sampler_def = self.models.policy_def
        if pool is not None or jax.process_count() > 1:
            self.sampler_def = ModelDef.of(
                lambda: Policy(self.models.cfg, sharder=pool, rngs=nnx.Rngs(0))
            )
        self.pool_shardings = None if pool is None else self.sampler_def.shardings(pool)
        self.engine_cfg, self.sampler_cfg = configs_from_section(
            config.sampling, stream_seed(config.seed, "rollouts")
        )
        # the native engine's compiled programs, built once: the evaluator's engines and
        # every in-process sampler of the run (value pretraining's, the RL loop's) share
        # them, so each program is traced and compiled once a run
        self.fns = generate_fns(self.sampler_def, self.engine_cfg)
        self.chat = inputs.chat  # None: raw text prompts
        # The bounds of every rollouts take (RL loop and value pretraining): docs/checkpointing.md
        self.take_bounds = dict(
            take_timeout_s=config.train.take_timeout_s,
            max_env_errors=self.sampler_cfg.max_env_errors,
            max_dropped_in_a_row=self.sampler_cfg.max_dropped_in_a_row,
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
            sampled_repeats=config.train.eval_sampled_repeats,
            seed=stream_seed(config.seed, "eval"),
            max_env_errors=self.sampler_cfg.max_env_errors,
            stall_timeout_s=config.train.take_timeout_s,
            fns=self.fns,
        )
        # rollouts' kwargs
        self.pool = dict(device_context=self.placement.pool_context, fns=self.fns)
        # sampling.backend (sao_jax/sampling/backend_factory.py): the run's one backend
        # (one vLLM server), lent to value pretraining's source, then the RL loop's, closed
        # by run(); the in-process rollouts generate with it (None: the sampler's own
        # engines); evaluation stays on the native engine
        self.backend = run_backend(
            config,
            mdef=self.sampler_def,
            tokenizer=self.tokenizer,
            workdir=workdir,
            seed=stream_seed(config.seed, "rollouts"),
            fns=self.fns,  # a native backend (the gateway's) runs the evaluator's programs
        )
        self.pool["backend"] = self.backend.sampler()
        t = config.train
        self.ckpt = checkpointing.Checkpointer(
            workdir / "checkpoints", keep=t.keep_checkpoints, async_save=t.async_checkpoints
        )
        self.writer = None  # created once the resume step is known (open_writers)
        self.samples = None
        self.key = jax.random.key(stream_seed(config.seed, "update"))
        self.loaded_critic: dict | None = None  # meta of a critic from init.critic_path

    def open_writers(self, resume_step: int) -> None:
        """metrics.jsonl and TensorBoard (and W&B with train.wandb_project) and the
        rollout samples, continuing after `resume_step` (-1: a fresh start)."""
        t, wandb = self.config.train, None
        if t.wandb_project:
            names = ("project", "entity", "name", "mode")
            wandb = {k: t[f"wandb_{k}"] for k in names} | {"config": self.config.to_dict()}
        self.writer = metrics.create_writers(self.workdir, resume_step=resume_step, wandb=wandb)
        self.samples = SampleWriter(
            self.workdir, self.tokenizer, t.samples_per_log, resume_step=resume_step
        )

    # ------------------------------------------------------------------------ stages

    def warm_start(self):
        """Stage (a): SFT on demonstrations, a HF checkpoint, or the random init."""
        cfg, models = self.config, self.models
        policy = models.policy
        if cfg.init.kind in ("hf", "random"):
            log.info(
                "warm start: the %s weights", "checkpoint's" if cfg.init.kind == "hf" else "random"
            )
        if cfg.init.kind == "params":
            policy = self.load_policy(cfg.init.params_path)
        if cfg.init.kind == "sft" and cfg.sft.steps > 0:
            demo_prompts = prompt_iterator(
                cfg.env.name,
                "train",
                seed=stream_seed(cfg.seed, "sft_prompts"),
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
                seed=stream_seed(cfg.seed, "sft_batches"),
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
        if cfg.init.critic_path and self.learner.uses_critic:
            critic, self.loaded_critic = value_pretrain.load_critic(
                cfg.init.critic_path, cfg, models.critic_def, self.sharder
            )
        elif models.critic is None:  # init.critic_path given, no critic used: none built
            critic = None
        else:
            critic = critic_params_from_policy(policy, models.critic)
        return self.learner.new_state(policy, critic, stream_seed(cfg.seed, "update"))

    def save_policy(self, path: pathlib.Path, policy) -> None:
        """Writes the warm-start policy, reusable by other runs (init.kind='params')."""
        with checkpointing.Checkpointer(path, keep=1, async_save=False) as c:
            c.save(0, policy, {"model": self.config.model.to_dict()})

    def load_policy(self, path: str):
        return load_policy(path, self.models.policy_def, self.sharder)

    def value_pretrain(self, state, stopper) -> tuple[Any, dict]:
        """Stage (b): value pretraining (sao_jax/run/value_pretrain.py); (state, summary).

        A critic loaded from init.critic_path is not pretrained again: its pretraining
        record is copied into this run's metrics. The RL critic optimizer is untouched (it
        starts fresh, so optim.critic.warmup_steps warms up the first RL steps)."""
        cfg, vp = self.config, self.config.value_pretrain
        if not self.learner.uses_critic:
            return state, {}
        writer = metrics.StageWriter(self.workdir, "value_pretrain", value_pretrain.STEP_KEY)
        try:
            if self.loaded_critic is not None:
                meta = self.loaded_critic
                for record in meta.get("history", []):
                    scalars = {k: acct.nan_from_json(v) for k, v in record.items()}
                    writer.write(int(scalars.pop(value_pretrain.STEP_KEY)), scalars)
                return state, {**meta["value_pretrain"], "source": cfg.init.critic_path}
            if vp.steps == 0:
                return state, {}
            log.info(
                "value pretraining: up to %d critic steps, %d rollouts each",
                vp.steps,
                vp.batch_size,
            )
            trainer = value_pretrain.ValuePretrainer(cfg, self.models.critic_def, self.sharder)
            source = self.pretrain_rollouts(state.policy)
            try:
                result = value_pretrain.pretrain(
                    trainer,
                    state.critic,
                    take=lambda n: source.take(n, cfg.train.take_timeout_s),
                    batch_of=lambda trajs: self._batch(trajs, for_learner=False),
                    write=writer.write,
                    should_stop=lambda: stopper.requested,
                    max_consecutive_skips=cfg.rl.max_consecutive_skips,
                )
            finally:
                source.stop()
        finally:
            writer.close()
        if result.summary["stop_reason"] != "interrupted":
            path = self.workdir / value_pretrain.CRITIC_SUBDIR
            value_pretrain.save_critic(path, result.critic, result, cfg)
        return state.replace(critic=result.critic), result.summary

    def pretrain_rollouts(self, policy):
        """The sampler of value pretraining: the fixed warm-start policy, published once
        and never again, on a prompt stream of its own (stream 'value_pretrain'), so the RL
        prompt stream is the same whether the critic was pretrained here or loaded."""
        cfg, vp = self.config, self.config.value_pretrain
        seed = stream_seed(cfg.seed, "value_pretrain")
        prompts = distributed.process_shard(run_prompts(cfg, seed=seed)[0])
        args = (self.sampler_def, self.tokenizer, self.env_factory, iter(prompts.to_iter_dataset()))
        if self.set_env_step is not None:
            self.set_env_step(PRETRAIN_STEP)
        if vp.sampler == "sync":
            source = SyncRollouts(
                *args, self.engine_cfg, seed=seed, **self.take_bounds, **self.pool
            )
        else:
            local = distributed.local_batch_size(vp.batch_size, "value_pretrain.batch_size")
            sampler_cfg = dataclasses.replace(
                self.sampler_cfg,
                seed=seed,
                max_staleness=None,
                lockstep=None,
                queue_size=max(self.sampler_cfg.queue_size, 2 * local),
            )
            source = AsyncRollouts(
                *args,
                self.engine_cfg,
                sampler_cfg,
                take_timeout_s=self.take_bounds["take_timeout_s"],
                **self.pool,
            )
        source.publish(self.sampler_params(policy), 0, synced=True)
        source.start()
        return source

    def _batch(self, trajs: list[Trajectory], for_learner: bool = True) -> dict[str, Any]:
        """The padded global batch of this host's trajectories with the fields the learner
        asks for (`Learner.batch_needs`; `for_learner` off, value pretraining: those the
        critic reads, `critic_batch_needs`), checked against its batch rules."""
        cfg = self.config
        needs = self.learner.batch_needs if for_learner else self.learner.critic_batch_needs
        length = None
        if jax.process_count() > 1:  # all hosts pad to the longest row of the global batch
            longest = distributed.agree_max(max(t.length for t in trajs))
            length = round_up(longest, cfg.train.length_bucket)
        kw = dict(
            length=length,
            length_bucket=cfg.train.length_bucket,
            with_groups="groups" in needs,
            with_routing="routing" in needs,
            baseline_key=cfg.rl.baseline_key if "baseline_keys" in needs else "",
            num_keys=cfg.rl.moving_average_keys,
        )
        if "critic_tokens" in needs:  # what a ceiling row's critic reads
            kw["critic_tokens"] = [privileged_tokens(t, self.tokenizer.encode) for t in trajs]
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
        if for_learner:
            self.learner.check_batch(batch)
        return batch

    def sampler_params(self, policy):
        """The weight sync: the params samplers and evaluation run on, i.e. the policy in
        the compute dtype (every weight is cast to it at use anyway, so rollouts are
        unchanged and a bf16 copy takes half the memory) in new buffers, on the pool's
        shardings when it has devices of its own, as this host's own copy with several
        processes (collective). Dispatched asynchronously: the copy runs behind the next
        update (sao_jax/parallel/reshard.py)."""
        return cast_and_reshard(
            policy,
            self.pool_shardings,
            self.models.cfg.compute_dtype,
            source_devices=self.placement.trainer_devices,
        )

    def _key(self, updates: int):
        """The key of update call number `updates` (TrainState.updates before it)."""
        return jax.random.fold_in(self.key, updates)

    def rollouts(self):
        cfg = self.config
        gateway = cfg.get("gateway")
        if gateway is not None and gateway.mode != "off":  # harness / live episodes
            from sao_jax.serve.source import GatewayRollouts  # aiohttp: gateway runs only

            return GatewayRollouts(
                gateway,
                policy_def=self.sampler_def,
                tokenizer=self.tokenizer,
                chat=self.chat,
                engine_cfg=self.engine_cfg,
                prompts=self.prompts,
                workdir=self.workdir,
                seed=stream_seed(cfg.seed, "rollouts"),
                queue_size=self.sampler_cfg.queue_size,
                max_env_errors=self.sampler_cfg.max_env_errors,
                take_timeout_s=cfg.train.take_timeout_s,
                backend=self.backend,
            )
        kw = dict(group_size=cfg.env.group_size)
        args = (self.sampler_def, self.tokenizer, self.env_factory, self.prompts)
        kw.update(self.pool)
        if cfg.train.rollouts == "sync":
            seed = stream_seed(cfg.seed, "sync_rollouts")
            return SyncRollouts(*args, self.engine_cfg, seed=seed, **kw, **self.take_bounds)
        timeout = self.take_bounds["take_timeout_s"]
        return AsyncRollouts(*args, self.engine_cfg, self.sampler_cfg, take_timeout_s=timeout, **kw)

    def evaluate(self, state, step: int) -> dict[str, float]:
        """Evaluation of the policy in `state`, whose version (state.step) is `step`."""
        log.info("eval at step %d: %d held-out prompts", step, len(self.evaluator.prompts))
        t0 = time.time()
        with self.placement.pool_context():
            out = self.evaluator(self.sampler_params(state.policy), step, step=step)
        out["eval/seconds"] = time.time() - t0
        self.writer.write_scalars(step, out)
        log.info("eval at step %d: %s", step, _fmt(out, "eval/"))
        return out

    def save(self, step: int, state, source, counters: dict, extra: dict) -> None:
        prompts = source.prompt_state() if source is not None else self.prompts.get_state()
        meta = dict(
            prompts=prompts,
            # every host's own position in its prompt slice (collective; a resumed host
            # restores its own: exact for each host with async rollouts too)
            prompts_by_process=[
                checkpointing.decode_meta(json.loads(b))
                for b in distributed.allgather_bytes(
                    json.dumps(checkpointing.encode_meta(prompts)).encode()
                )
            ],
            counters=counters,
            before=extra["before"],
            value_pretrain=acct.finite(extra.get("value_pretrain", {})),
            wall_time=acct.wall_time(extra),
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
    log.info("checking the config and the inputs (workdir %s)", workdir)
    config = config_lib.validate(config)
    placement = placement_from_config(config)
    sharder = trainer_sharder(config, placement)
    check_run(config, sharder)
    config = resolved_config(config)  # init.kind='hf': the checkpoint's model and tokenizer
    inputs = read_inputs(config)  # a bad input file stops here, before the workdir exists
    lengths = preflight.check_inputs(config, inputs)  # prompt lengths, vocab, tools
    workdir = pathlib.Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"flag --workdir: {workdir} exists and is not a directory")
    workdir.mkdir(parents=True, exist_ok=True)
    checkpointing.check_workdir_config(
        workdir, config.to_dict(), overwrite=overwrite, defaults=default_config().to_dict()
    )
    checkpointing.keep_sources(workdir, config)  # tokenizer files, the HF config.json
    if (done := acct.finished(workdir, config.train.total_steps)) is not None:
        return done  # nothing to do, nothing rewritten (one line says so)
    for line in startup_lines(config, inputs, lengths, sharder, placement):
        log.info("%s", line)
    log.info("building the policy, the critic and the learner")
    t_start = time.time()
    r = Run(config, workdir, sharder, inputs, placement)
    t = config.train
    # the run's one backend (a vLLM server) closed on every way out, errors included,
    # while signals are still caught (a second SIGTERM cannot leave its process behind)
    with checkpointing.GracefulExit() as stopper, contextlib.closing(r.backend):
        latest = r.ckpt.latest_step()
        if latest is None:
            r.open_writers(resume_step=-1)
            try:
                state = r.warm_start()
                before = r.evaluate(state, 0)
                state, pretrained = r.value_pretrain(state, stopper)
                stop.raise_if_requested("value pretraining")
            except stop.StopRequested as e:  # nothing resumable yet: the next run starts over
                log.warning("%s, before the first checkpoint: exiting without one", e)
                return _close(r, workdir, t, dict(steps=0, interrupted=True, before={}))
            extra = dict(
                before=before, value_pretrain=pretrained, prior_wall_time=0.0, t_start=t_start
            )
            counters = acct.resume_counters({})
            r.save(0, state, None, acct.counters(counters, {}), extra)
        else:
            abstract = checkpointing.abstract_like(
                r.learner.abstract_state, r.learner.state_shardings
            )
            state, meta = r.ckpt.restore(abstract)
            mine = meta.get("prompts_by_process", [])  # absent in older checkpoints
            own = len(mine) == jax.process_count()
            r.prompts.set_state(mine[jax.process_index()] if own else meta["prompts"])
            r.open_writers(resume_step=int(state.step))
            extra = dict(
                before=meta["before"],
                value_pretrain=meta.get("value_pretrain", {}),
                prior_wall_time=meta["wall_time"],
                t_start=t_start,
            )
            counters = acct.resume_counters(meta.get("counters", {}))
            restored = r.ckpt.restored_step  # older than `latest` after a fallback
            fallback = (
                f", the newest readable; checkpoint {latest} was not" if restored != latest else ""
            )
            log.info("resumed from step %d (checkpoint %d%s)", int(state.step), restored, fallback)
        summary = _rl(r, state, counters, extra, stopper, t_start)
    return _close(r, workdir, t, summary)


def _close(r: Run, workdir: pathlib.Path, t, summary: dict) -> dict:
    r.ckpt.wait()
    r.ckpt.close()
    r.writer.close()
    if t.report and distributed.is_primary() and summary.get("steps"):
        from sao_jax.report import run_report  # matplotlib: imported by runs that plot

        run_report.write_report(workdir, summary=summary)
    text = json.dumps(acct.finite(summary), indent=2, sort_keys=True, allow_nan=False)
    if distributed.is_primary():
        (workdir / acct.SUMMARY_FILE).write_text(text)
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
    # The step (policy version) and the update calls done, read from the device once here
    # and then once per update: `updates` grows by one every call, `step` only with an
    # update that was not skipped (a non-finite one keeps the state).
    step, updates = int(state.step), int(state.updates)
    source = r.rollouts()
    if r.set_env_step is not None:
        r.set_env_step(step)
    source.publish(r.sampler_params(state.policy), step, synced=True)
    source.start()
    log.info("RL: at step %d of %d, %d trajectories a step", step, t.total_steps, b)
    acc = metrics.MetricAccumulator()
    host: list[dict[str, float]] = []
    env_log = acct.EnvLog()
    progress = Progress(t.total_steps, initial=min(step, t.total_steps), enabled=t.progress)
    tokens, t_log = 0, time.time()
    last = {}
    stopped = False
    try:
        while step < t.total_steps:
            try:
                trajs = take_or_stop(source, b, t.take_timeout_s, stopper)
            except Exception as e:
                if engine_died(e):  # the last completed step, kept; the run then ends
                    log.error("the generation engine died: checkpoint of step %d", step)
                    r.save(step, state, source, acct.counters(counters, source.stats()), extra)
                    r.ckpt.wait()  # committed before the error ends the process
                raise
            if trajs is None:
                stopped = True
                break
            batch = r._batch(trajs)
            version = step  # the policy this batch's staleness is measured against
            host.append(acct.host_stats(trajs, version))
            env_log.add(trajs)
            tokens += int(batch["action_mask"].sum())
            key, updates = r._key(updates), updates + 1
            if updates <= cfg.rl.critic_only_steps:
                state, m = learner.value_step(state, batch, key)  # critic warm-up
                acc.add(m)
                continue
            if version + 1 in t.token_dump_steps:  # before the update donates it
                probe = jax.device_get(learner.token_probe(state, batch))
                token_dump.write(r.workdir, version + 1, probe, batch["action_mask"])
            state, m = learner.update_step(state, batch, key)
            # weight sync, dispatched behind the update (before the step is read, which
            # waits for it): the pool keeps decoding the previous version until it lands
            params = r.sampler_params(state.policy)
            step = int(state.step)
            source.publish(params, step, synced=True)
            if r.set_env_step is not None:  # non-stationary tasks follow the policy step
                r.set_env_step(step)
            acc.add(m)
            if step % t.log_every == 0 or step == t.total_steps:
                learner.raise_if_diverged(state)
                now = time.time()
                scalars = {**acc.result(), **acct.mean_rows(host), **env_log.scalars()}
                scalars["perf/action_tokens_per_s"] = tokens / max(now - t_log, 1e-9)
                scalars["train/skipped_steps"] = float(state.skipped_steps)
                scalars.update(acct.sampler_scalars(source.stats(), counters))
                r.writer.write_scalars(step, scalars)
                r.samples.write(step, version, trajs, r.writer)
                progress.update(step, scalars)
                last = scalars
                acc, host, tokens, t_log = metrics.MetricAccumulator(), [], 0, now
            if t.eval_every and step % t.eval_every == 0 and step < t.total_steps:
                _unless_stopped(r.evaluate, state, step)
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.total_steps:
                r.save(step, state, source, acct.counters(counters, source.stats()), extra)
    finally:
        source.stop()
        r.backend.close()  # its last user: the final evaluation runs without the server
        progress.close()
    after = {}
    if step >= t.total_steps and not stopped:
        after = _unless_stopped(r.evaluate, state, step) or {}
    r.save(step, state, source, acct.counters(counters, source.stats()), extra)
    return dict(
        steps=step,
        before=extra["before"],
        after=after,
        value_pretrain=extra.get("value_pretrain", {}),
        last_train=last,
        counters=acct.counters(counters, source.stats()),
        staleness_hist=source.stats().get("staleness", {}),
        wall_time_s=acct.wall_time(extra),
        machine=acct.machine(),
        interrupted=bool(stopped or stopper.requested),
    )


def take_or_stop(source, n: int, timeout: float, stopper) -> list[Trajectory] | None:
    """This step's n trajectories, or None when any process stops: this one was signalled
    (before or during the take), or another one was (what this one took is then given
    back, so the checkpoint counts it in flight and a sync run resumes with that take).
    Collective (`agree_stop`): every process calls it once per step, before the step's
    first collective."""
    trajs = None
    if not stopper.requested:
        try:
            trajs = source.take(n, timeout)
        except stop.StopRequested as e:
            log.warning("%s", e)
    if not distributed.agree_stop(trajs is None):
        return trajs
    if trajs:
        source.give_back(trajs)
    return None


def _unless_stopped(fn, *args):
    """fn(*args), or None when a stop request interrupted it (host-local work only: the
    decision to stop is agreed at the top of the next step)."""
    try:
        return fn(*args)
    except stop.StopRequested as e:
        log.warning("%s: skipped", e)
        return None
