"""Value pretraining (docs/method.md section 3, the fourth design): before RL, the critic
regresses the Monte-Carlo returns of fresh rollouts of the fixed warm-start policy.

* Data: a stream of fresh rollouts from a sampler running the warm-start policy, which is
  never republished. Every optimizer step takes `batch_size` new rollouts (`reuse` > 1
  trains on each batch that many times); the corpus is at most steps x batch_size / reuse
  rollouts. Epochs over a small fixed set memorise it (held-out EV falls while in-sample
  EV rises), so there are none.
* Targets: observed Monte-Carlo returns, lambda = 1 and no bootstrap, discount rl.gamma
  (`sao_jax.rl.gae.monte_carlo_returns`), whatever rl.lam_critic says.
* Held out: `heldout_rollouts` rollouts sampled first and never trained on (training
  rollouts of their prompts are skipped). Their explained variance and value loss are
  measured at step 0, every `eval_every` steps and at the last step.
* Stop: after `patience` held-out evaluations in a row without an EV gain of at least
  `min_delta` (over the EV of the last such gain), or at `steps`. The reason is logged.
* Independent of every RL-time setting: its own trainable set (`trainable`), learning
  rate (`lr`; 0 reuses optim.critic.lr) and warm-up, and its own optimizer state, which
  is discarded: the RL critic's optimizer starts fresh, so optim.critic.warmup_steps
  warms up the first RL steps. rl.k_critic, rl.lam_critic and optim.critic's trainable
  set are not read (sao_jax.run.settings.PRETRAIN_READS lists what is), so rows that
  differ only in those get bit-identical critics; sweeps pretrain once per seed and share
  it (sao_jax/sweep/).

Metrics (one record per step; names under `value_pretrain/`, with its own step counter
`value_pretrain/step`): `batch/*` on the step's fresh rollouts BEFORE the update, which
the critic has not seen (value_loss, explained_variance), `heldout/*` on the held-out set
(value_loss, explained_variance, best_explained_variance), lr, grad_norm, loss, skipped
and rollouts (fresh training rollouts consumed).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax import checkpointing
from sao_jax import metrics as metrics_lib
from sao_jax.parallel import distributed
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.rl import losses
from sao_jax.rl import metrics as rm
from sao_jax.rl import passes as P
from sao_jax.rl.gae import monte_carlo_returns
from sao_jax.rl.optim import (
    apply_updates,
    make_optimizer,
    schedule,
    trainable_labels,
    update_count,
)
from sao_jax.rl.state import optimizer_shardings
from sao_jax.rl.update import NonFiniteError
from sao_jax.run.settings import WARM_START_CRITIC_SUBDIR, pretraining_fields
from sao_jax.schema import ConfigDict, ConfigError

log = logging.getLogger("sao_jax")
CRITIC_SUBDIR = WARM_START_CRITIC_SUBDIR  # <workdir>/...: its critic (init.critic_path)
PREFIX = "value_pretrain"
STEP_KEY = f"{PREFIX}/step"


def optimizer_config(config: ConfigDict) -> ConfigDict:
    """The pretraining AdamW: optim.critic's b1, b2, eps and weight decay, with
    value_pretrain's lr (0: optim.critic.lr), clipping (-1: optim.critic's) and warm-up,
    then a constant lr."""
    vp = config.value_pretrain
    c = config.optim.critic.copy_and_resolve_references()
    c.unlock()
    c.lr = vp.lr if vp.lr > 0 else config.optim.critic.lr
    if vp.max_grad_norm >= 0:
        c.max_grad_norm = vp.max_grad_norm
    c.warmup_steps = vp.warmup_steps
    c.decay = "constant"
    return c


class ValuePretrainer:
    """The jitted critic step and held-out evaluation of value pretraining."""

    def __init__(self, config: ConfigDict, critic_def: ModelDef, sharder: Sharder):
        vp = config.value_pretrain
        self.vp, self.gamma, self.microbatches = vp, config.rl.gamma, config.rl.microbatches
        self.critic_def, self.sharder = critic_def, sharder
        shapes = critic_def.shapes()
        self.frozen = trainable_labels(shapes, vp.trainable, config.optim.critic.frozen_patterns)
        opt_cfg = optimizer_config(config)
        self.tx = make_optimizer(opt_cfg, frozen=self.frozen)
        self.lr = schedule(opt_cfg)
        self.max_grad_norm = opt_cfg.max_grad_norm
        self.traces = {"step": 0, "evaluate": 0}
        critic_sh = critic_def.shardings(sharder)
        opt_sh = optimizer_shardings(
            self.tx, jax.eval_shape(self.tx.init, shapes), critic_sh, sharder
        )
        if sharder.mesh is None:
            self.init_opt = jax.jit(self.tx.init)
            self.step = jax.jit(self._step, donate_argnums=(0, 1))
            self.evaluate = jax.jit(self._evaluate)
        else:
            rep = NamedSharding(sharder.mesh, PartitionSpec())
            batch_sh = NamedSharding(sharder.mesh, sharder.spec(("batch",)))
            self.init_opt = jax.jit(self.tx.init, out_shardings=opt_sh)
            self.step = jax.jit(
                self._step,
                donate_argnums=(0, 1),
                in_shardings=(critic_sh, opt_sh, batch_sh),
                out_shardings=(critic_sh, opt_sh, rep),
            )
            self.evaluate = jax.jit(
                self._evaluate, in_shardings=(critic_sh, batch_sh), out_shardings=rep
            )

    def _loss_terms(self, values_bt, batch, n_tok):
        targets_bt = monte_carlo_returns(batch["rewards"], batch["action_mask"], self.gamma)
        return losses.value_loss(values_bt, targets_bt, batch["action_mask"], denominator=n_tok)

    def _step(self, critic: Params, opt, batch):
        """One optimizer step on the masked value MSE against Monte-Carlo returns; a
        non-finite loss or gradient leaves critic and optimizer unchanged (`skipped`)."""
        self.traces["step"] += 1  # Python side effect: runs once per trace
        n_tok = jnp.maximum(jnp.sum(batch["action_mask"]), 1).astype(jnp.float32)
        frozen = self.frozen

        def loss_fn(params, mb):
            if frozen is not None:  # no backward pass into frozen leaves
                params = jax.tree.map(
                    lambda lab, p: jax.lax.stop_gradient(p) if lab == "frozen" else p,
                    frozen,
                    params,
                )
            out = P.critic_pass(self.critic_def.bind(params), mb)
            loss, metrics = self._loss_terms(out["values"], mb, n_tok)
            return loss + out["aux_loss"] / self.microbatches, metrics

        lr = self.lr(update_count(opt))
        loss, grads, metrics = P.accumulate_grads(
            loss_fn, critic, batch, self.microbatches, self.sharder
        )
        updates, new_opt = self.tx.update(grads, opt, critic)
        new_critic = apply_updates(critic, updates, frozen)
        ok = jnp.isfinite(loss) & jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
        )
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        one = lambda x: (jnp.asarray(x, jnp.float32), jnp.ones((), jnp.float32))
        out = {f"batch/{k}": v for k, v in metrics.items()}
        out |= rm.step_metrics(loss, grads, self.max_grad_norm)
        out |= dict(lr=one(lr), skipped=one(~ok))
        return keep(new_critic, critic), keep(new_opt, opt), out

    def _evaluate(self, critic: Params, batch):
        """(sum, count) value metrics of the critic on a batch (no update)."""
        self.traces["evaluate"] += 1
        model = self.critic_def.bind(critic)
        fn = lambda mb: P.critic_pass(model, mb)["values"]
        values_bt = P.map_microbatches(fn, batch, self.microbatches, self.sharder)
        return {f"heldout/{k}": v for k, v in self._loss_terms(values_bt, batch, None)[1].items()}


@dataclasses.dataclass
class Result:
    critic: Params
    summary: dict[str, Any]  # steps, rollouts, EVs, stop reason, wall times
    history: list[dict[str, float]]  # the logged records, in order


class PlateauStop:
    """Held-out EV plateau, as early stopping usually reads it: `done` after `patience`
    evaluations in a row without a gain of at least `min_delta` over `best`, the EV of
    the last such gain (patience 0: never). `top` / `top_step`: the highest EV seen."""

    def __init__(self, patience: int, min_delta: float):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.since = -math.inf, 0
        self.top, self.top_step = -math.inf, 0

    def update(self, step: int, ev: float) -> None:
        finite = math.isfinite(ev)
        if finite and ev > self.top:
            self.top, self.top_step = ev, step
        if finite and ev >= self.best + self.min_delta:
            self.best, self.since = ev, 0
        else:
            self.since += 1

    @property
    def done(self) -> bool:
        return self.patience > 0 and self.since >= self.patience


def pretrain(
    trainer: ValuePretrainer,
    critic: Params,
    *,
    take: Callable[[int], Sequence[Any]],
    batch_of: Callable[[Sequence[Any]], dict[str, Any]],
    write: Callable[[int, dict[str, float]], None] = lambda step, scalars: None,
    uid: Callable[[Any], Hashable] = lambda traj: traj.prompt_uid,
    should_stop: Callable[[], bool] = lambda: False,
    max_consecutive_skips: int = 10,
    loop: ConfigDict | None = None,
) -> Result:
    """Runs value pretraining (module doc) from `critic` (donated); returns the result.

    take(n): the next n fresh rollouts of the fixed policy (this host's share).
    batch_of(rollouts): the padded global training batch of those rollouts.
    write(step, scalars): logs one record (every step, step 0 included).
    uid(rollout): its prompt's identity (rollouts of held-out prompts are not trained on).
    should_stop(): an interrupt was requested (SIGTERM): stop after the current step.
    loop: a value_pretrain section whose host-side fields (steps, batch_size, reuse,
      heldout_rollouts, eval_every, patience, min_delta) replace the trainer's own.
    """
    vp, t0 = loop or trainer.vp, time.time()
    local = distributed.local_batch_size(vp.batch_size, "value_pretrain.batch_size")
    waited = [0.0]  # seconds spent waiting for rollouts

    def timed_take(n: int) -> list[Any]:
        t = time.time()
        out = list(take(n))
        waited[0] += time.time() - t
        return out

    held_rollouts = [timed_take(local) for _ in range(vp.heldout_rollouts // vp.batch_size)]
    heldout = [batch_of(chunk) for chunk in held_rollouts]
    held_uids = {uid(r) for chunk in held_rollouts for r in chunk}
    counts = {"rollouts": 0, "skipped_heldout_prompts": 0}

    def fresh(n: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            got = timed_take(n - len(out))
            kept = [r for r in got if uid(r) not in held_uids]
            counts["skipped_heldout_prompts"] += len(got) - len(kept)
            out += kept
        counts["rollouts"] += len(out)
        return out

    def evaluate(params) -> dict[str, float]:
        acc = metrics_lib.MetricAccumulator()
        for batch in heldout:
            acc.add(trainer.evaluate(params, batch))
        return _shown(acc.result())

    history: list[dict[str, float]] = []

    def record(step: int, scalars: dict[str, float]) -> None:
        scalars = {f"{PREFIX}/{k}": v for k, v in scalars.items()}
        history.append({STEP_KEY: step, **scalars})
        write(step, scalars)

    plateau = PlateauStop(vp.patience, vp.min_delta)
    held = evaluate(critic)
    start_ev = held["heldout/explained_variance"]
    plateau.update(0, start_ev)
    record(0, {**held, "heldout/best_explained_variance": plateau.top, "rollouts": 0})
    log.info("value pretraining: held-out EV %.4f at step 0 (%d rollouts)", start_ev,
             vp.heldout_rollouts)  # fmt: skip
    opt = trainer.init_opt(critic)
    step, batch, skips, final_ev = 0, None, 0, start_ev
    reason = f"reached value_pretrain.steps={vp.steps}"
    while step < vp.steps:
        if step % vp.reuse == 0:
            batch = batch_of(fresh(local))
        critic, opt, m = trainer.step(critic, opt, batch)
        step += 1
        scalars = _shown(metrics_lib.reduce_sum_count(m))
        scalars["rollouts"] = float(counts["rollouts"])
        skips = skips + 1 if scalars["skipped"] else 0
        if skips >= max_consecutive_skips:
            raise NonFiniteError(
                f"value pretraining: {skips} consecutive steps had a non-finite loss or gradient"
            )
        interrupted = should_stop()
        if step % vp.eval_every == 0 or step == vp.steps or interrupted:
            scalars |= evaluate(critic)
            final_ev = scalars["heldout/explained_variance"]
            plateau.update(step, final_ev)
            scalars["heldout/best_explained_variance"] = plateau.top
            log.info(
                "value pretraining step %d: held-out EV %.4f (best %.4f at step %d), "
                "batch EV before update %.4f, %d rollouts",
                step, final_ev, plateau.top, plateau.top_step,
                scalars["batch/explained_variance"], counts["rollouts"],
            )  # fmt: skip
        record(step, scalars)
        if interrupted:
            reason = "interrupted"
            break
        if plateau.done:
            reason = (
                f"plateau: {vp.patience} held-out evaluations without an EV gain >= "
                f"{vp.min_delta} over {plateau.best:.4f} (best {plateau.top:.4f} at step "
                f"{plateau.top_step})"
            )
            break
    wall = time.time() - t0
    summary = dict(
        steps=step,
        rollouts=counts["rollouts"],
        heldout_rollouts=vp.heldout_rollouts,
        skipped_heldout_prompts=counts["skipped_heldout_prompts"],
        heldout_ev_start=start_ev,
        heldout_ev_final=final_ev,
        heldout_ev_best=plateau.top,
        heldout_ev_best_step=plateau.top_step,
        stop_reason=reason,
        wall_time_s=wall,
        rollout_wait_s=waited[0],
    )
    log.info("value pretraining done after %d steps (%.0f s): %s", step, wall, reason)
    return Result(critic, summary, history)


def save_critic(path: str | os.PathLike, critic: Params, result: Result, config) -> None:
    """Writes the pretrained critic; its meta holds the summary, the history and the
    config fields the pretraining read (`load_critic` checks them)."""
    meta = dict(
        model=config.model.to_dict(),
        value_pretrain=result.summary,
        history=result.history,
        fields=pretraining_fields(config),
    )
    with checkpointing.Checkpointer(path, keep=1, async_save=False) as c:
        c.save(0, critic, _finite(meta), force=True)  # a rerun's pretraining replaces it


def load_critic(
    path: str | os.PathLike, config: ConfigDict, critic_def: ModelDef, sharder: Sharder
) -> tuple[Params, dict[str, Any]]:
    """(critic, meta) of a run's <workdir>/warm_start_critic; ConfigError naming the
    first differing field when it was pretrained with other settings than `config`'s
    (sao_jax.run.settings.pretraining_fields)."""
    with checkpointing.Checkpointer(path, keep=1, async_save=False) as c:
        critic, meta = c.restore(
            checkpointing.abstract_like(critic_def.shapes(), critic_def.shardings(sharder))
        )
    theirs, ours = meta.get("fields", {}), pretraining_fields(config)
    diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if diff:
        raise ConfigError(
            f"config field init.critic_path: {path} was value-pretrained with other settings: "
            f"{diff[0]} = {theirs.get(diff[0])!r} there, {ours.get(diff[0])!r} here"
        )
    log.info("warm start: value-pretrained critic from %s", path)
    return critic, meta


def _finite(x: Any) -> Any:
    """`x` with non-finite floats as None (checkpoint meta is strict JSON)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


# Shown per record: means and explained variances, not the E[x^2] / std helpers.
_HIDDEN_SUFFIXES = ("_sq", "_std", "value_residual")


def _shown(scalars: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in scalars.items() if not k.endswith(_HIDDEN_SUFFIXES)}
