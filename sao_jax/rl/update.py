"""The pure SAO update step, `update_step(state, batch, key) -> (state, metrics)`.

One call, with `rl.order == 'critic_first'` (the default):
  1. V0 = critic(batch); critic targets R from V0 (`rl.critic_target`: 'lambda' = GAE
     returns at `lam_critic`; 'brace' = the anchored Bellman-residual target, which also
     reads the log ratio of the current policy to the rollout engine: one policy forward
     without gradient first, sao_jax/rl/critic_targets.py).
  2. K critic optimizer steps on the masked value MSE against R (TTUR; K = rl.k_critic).
     V0 is the first critic step's own forward (same parameters, per microbatch: the
     targets of a row need only that row's values), pulled back with `jax.vjp` once the
     targets are known, so no separate critic forward is run for it. The result is
     bit-identical to a separate V0 pass (`initial_values`; tests/test_critic_v0.py).
  3. V1 = the updated critic(batch); policy advantages from V1 with the length-adaptive
     lambda (or the configured estimator: GRPO, moving average, ... skip the critic).
  4. The policy's optimizer steps with the configured loss (DIS by default): one step on
     the whole batch (SAO), or `rl.ppo_epochs` x `rl.minibatches` minibatch steps (the
     PPO rows, as veRL / OpenRLHF run them; `policy_step`).
With 'policy_first', advantages come from V0, the policy step is taken, then the K
critic steps. `value_step` runs steps 1-2 only: the critic warm-up read as critic-only
RL steps (`rl.critic_only_steps`). Value pretraining before RL is sao_jax/run/value_pretrain.py.

Critic metrics: `critic/ev_pre_update` is the explained variance of the values BEFORE this
update's critic steps on the batch, which the critic has never trained on (the honest
number), `critic/ev_post_update` that of the values after them (in-sample), both against
the observed Monte-Carlo returns (`gae.monte_carlo_returns`: lambda = 1, no bootstrap).
`obs/*` are the pre-update values' changes across observation spans and the share of
the return's variance they explain (sao_jax/rl/value_jumps.py), whatever the estimator.

Both are jitted once with explicit shardings and the state donated. A non-finite loss
or gradient anywhere skips the whole update (parameters and optimizer states unchanged)
and counts it; the host raises after `rl.max_consecutive_skips` skips in a row.
Metrics are name -> (sum, count), summed over microbatches, reduced on the host.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax.batch_schema import fields_for
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.rl import advantages as adv_lib
from sao_jax.rl import critic_targets, gae, losses, value_jumps
from sao_jax.rl import metrics as rm
from sao_jax.rl import passes as P
from sao_jax.rl.batch import check_batch, check_divisible, token_staleness
from sao_jax.rl.optim import (
    apply_updates,
    critic_frozen_labels,
    make_optimizer,
    schedule,
    update_count,
)
from sao_jax.rl.settings import estimator_params, loss_params, target_params
from sao_jax.rl.state import TrainState, init_state, state_shardings
from sao_jax.schema import ConfigDict, ConfigError


def minibatch_indices(key, batch_size: int, epochs: int, minibatches: int) -> jax.Array:
    """[epochs * minibatches, batch_size // minibatches] int32 row indices: epoch e is the
    permutation of the rows drawn with fold_in(key, e), cut into `minibatches` parts."""
    perm = lambda e: jax.random.permutation(jax.random.fold_in(key, e), batch_size)
    perms_eb = jax.vmap(perm)(jnp.arange(epochs))  # [E, B]
    return perms_eb.reshape(epochs * minibatches, batch_size // minibatches).astype(jnp.int32)


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class CriticRun(NamedTuple):
    """What `Learner.critic_steps` hands back: the critic after its K steps."""

    critic: Params
    critic_opt: Any
    ok: jax.Array  # bool: every step's loss and gradients finite
    metrics: dict  # the first and last step's metrics, the targets' metrics
    targets_bt: jax.Array  # [B, T] the fixed value targets R, from V0
    values0: dict[str, jax.Array]  # V0: "values" [B, T], "bootstrap" [B]


class Learner:
    """Builds `update_step` and `value_step` for one config, model pair and mesh: the
    config's `rl` section (the RL math) and its `optim` section (the two optimizers)."""

    def __init__(
        self,
        rl: ConfigDict,
        optim: ConfigDict,
        policy_def: ModelDef,
        critic_def: ModelDef | None,
        sharder: Sharder,
    ):
        self.rl = rl
        self.sharder = sharder
        self.policy_def = policy_def
        self.critic_def = critic_def
        self.estimator = adv_lib.estimator(rl.advantage)
        self.uses_critic = self.estimator.needs_values
        if self.uses_critic and critic_def is None:
            raise ConfigError(f"config field rl.advantage: {rl.advantage!r} needs a critic model")
        self.loss_entry = losses.LOSSES.get(rl.policy_loss)
        if self.loss_entry.kind != "policy":
            raise ConfigError(
                f"config field rl.policy_loss: {rl.policy_loss!r} is not a policy loss"
            )
        self.loss_kwargs = loss_params(rl)
        self.estimator_kwargs = estimator_params(rl)
        self.target_entry = critic_targets.CRITIC_TARGETS.get(rl.critic_target)
        self.target_kwargs = target_params(rl)
        # The batch fields beyond the always-present ones (sao_jax/batch_schema.py NEEDS):
        # what the update step reads, and what the critic's passes alone read.
        needs = {"critic_tokens"} if rl.privileged_critic else set()
        self.critic_batch_needs = frozenset(needs)
        needs |= {"groups"} if self.estimator.needs_groups else set()
        needs |= {"baseline_keys"} if rl.baseline_key else set()
        needs |= {"routing"} if rl.routing_replay else set()
        self.batch_needs = frozenset(needs)
        self.batch_fields = fields_for(needs)  # their names (a padded batch)
        critic_shapes = critic_def.shapes() if self.uses_critic else {}
        self.critic_frozen = (
            critic_frozen_labels(critic_shapes, optim.critic) if self.uses_critic else None
        )
        self.policy_tx = make_optimizer(optim.policy)
        # The critic's schedule (its warm-up) counts RL steps: K optimizer steps each.
        self.critic_tx = make_optimizer(optim.critic, frozen=self.critic_frozen, every=rl.k_critic)
        self.policy_clip = optim.policy.max_grad_norm  # 0: no clip
        self.critic_clip = optim.critic.max_grad_norm
        self.policy_lr = schedule(optim.policy)
        self.critic_lr = schedule(optim.critic, every=rl.k_critic)
        self.init_state = functools.partial(
            init_state,
            policy_tx=self.policy_tx,
            critic_tx=self.critic_tx,
            window=rl.moving_average_window,
            keys=rl.moving_average_keys,
        )

        policy_sh = policy_def.shardings(sharder)
        critic_sh = critic_def.shardings(sharder) if self.uses_critic else None
        self.abstract_state = abstract = jax.eval_shape(
            lambda: self.init_state(policy_def.shapes(), critic_shapes, seed=0)
        )
        self.state_shardings = state_shardings(
            abstract, policy_sh, critic_sh, self.policy_tx, self.critic_tx, sharder
        )
        jit = functools.partial(jax.jit, donate_argnums=0)
        if sharder.mesh is not None:
            rep = NamedSharding(sharder.mesh, PartitionSpec())
            batch_sh = NamedSharding(sharder.mesh, sharder.spec(("batch",)))
            jit = functools.partial(
                jax.jit,
                donate_argnums=0,
                in_shardings=(self.state_shardings, batch_sh, rep),
                out_shardings=(self.state_shardings, rep),
            )
        self.update_step = jit(self._update_step)
        self.value_step = jit(self._value_step)
        self.token_probe = jax.jit(self._token_probe)  # compiled on first use only
        self._jit_init = jax.jit(
            self.init_state,
            static_argnames="seed",
            out_shardings=self.state_shardings,
        )

    # ------------------------------------------------------------------ host helpers

    def new_state(self, policy: Params, critic: Params | None, seed: int) -> TrainState:
        """A sharded TrainState around the given params (critic ignored if unused)."""
        return self._jit_init(policy, critic if self.uses_critic else {}, seed=seed)

    def check_batch(self, batch: dict[str, Any]) -> None:
        """Shape/dtype checks naming the field, before anything compiles: the fields of
        `batch_needs` present (a packed batch: their packed forms), rows divisible."""
        packed = "packed_tokens" in batch  # model passes on packed rows (rl/packing.py)
        check_batch(batch, needs=self.batch_needs | ({"packed"} if packed else set()))
        m, mini = self.rl.microbatches, self.rl.minibatches
        shards = self.sharder.axis_size("batch")
        split = dict(microbatches=m, shards=shards)
        check_divisible(batch["tokens"].shape[0], "batch size", minibatches=mini, **split)
        if packed:
            check_divisible(batch["packed_tokens"].shape[0], "packed rows of the batch", **split)

    def raise_if_diverged(self, state: TrainState) -> None:
        n = int(jax.device_get(state.consecutive_skips))
        if n >= self.rl.max_consecutive_skips:
            raise NonFiniteError(
                f"{n} consecutive updates had a non-finite loss or gradient "
                f"(rl.max_consecutive_skips={self.rl.max_consecutive_skips}); "
                f"{int(jax.device_get(state.skipped_steps))} skipped in total"
            )

    # --------------------------------------------------------------------- the math

    def initial_values(self, critic: Params, batch) -> dict[str, jax.Array] | None:
        """V0, the values the critic targets come from, before the K critic steps; None:
        from the first critic step's own forward (one critic forward fewer). The earlier
        form, a separate V0 pass, is a subclass returning `critic_values(critic, batch)`
        (tests/test_critic_v0.py checks both agree bit for bit; benches time them)."""
        del critic, batch
        return None

    def critic_values(self, critic: Params, batch) -> dict[str, jax.Array]:
        model = self.critic_def.bind(critic)
        fn = lambda mb: {k: v for k, v in P.critic_pass(model, mb).items() if k != "aux_loss"}
        out = P.map_microbatches(fn, batch, self.rl.microbatches, self.sharder)
        return jax.lax.stop_gradient(out)

    def _bootstrap(self, batch, values: dict[str, jax.Array]) -> jax.Array:
        return jnp.where(batch["terminated"], 0.0, values["bootstrap"])

    def _advantages(self, batch, values, lam, baseline) -> adv_lib.Advantages:
        has_values = values is not None
        return adv_lib.compute_advantages(
            self.rl.advantage,
            rewards_bt=batch["rewards"],
            outcome_b=batch["outcome"],
            action_mask_bt=batch["action_mask"],
            values_bt=values["values"] if has_values else None,
            last_value_b=self._bootstrap(batch, values) if has_values else None,
            turn_ids_bt=batch["turn_ids"],
            group_ids_b=batch.get("group_ids"),
            baseline_state=baseline,
            baseline_keys_b=batch.get("baseline_keys"),
            gamma=self.rl.gamma,
            lam=lam,
            eps=self.rl.group_eps,
            **self.estimator_kwargs,
        )

    def _policy_lambda(self, batch):
        if self.rl.lam_mode == "adaptive":
            return gae.length_adaptive_lambda(batch["action_mask"], self.rl.lam_alpha)
        return self.rl.lam_fixed

    def _critic_loss(self, out, mb, n_tok):
        """Masked value loss of a critic pass `out` against mb's fixed targets, + MoE aux."""
        rl = self.rl
        loss, metrics = losses.value_loss(
            out["values"],
            mb["targets"],
            mb["action_mask"],
            old_values_bt=mb["old_values"],
            clip_eps=rl.value_clip if rl.value_clip > 0 else None,
            denominator=n_tok,
        )
        return loss + out["aux_loss"] / rl.microbatches, metrics

    def _critic_forward(self, params, mb):
        """critic_pass with no backward pass into frozen leaves."""
        if self.critic_frozen is not None:
            params = jax.tree.map(
                lambda lab, p: jax.lax.stop_gradient(p) if lab == "frozen" else p,
                self.critic_frozen,
                params,
            )
        return P.critic_pass(self.critic_def.bind(params), mb)

    def _critic_targets(self, mb, values0):
        """(mb with the critic targets R from V0 and V0 itself, the targets' metrics). R:
        `rl.critic_target` (sao_jax/rl/critic_targets.py): 'lambda' = the estimator's
        returns at lam_critic; 'brace' reads mb's `target_log_ratio` (`with_target_inputs`)."""
        rl = self.rl
        targets, metrics = critic_targets.critic_targets(
            rl.critic_target,
            rewards_bt=mb["rewards"],
            values_bt=values0["values"],
            action_mask_bt=mb["action_mask"],
            log_ratio_bt=mb.get("target_log_ratio"),
            last_value_b=self._bootstrap(mb, values0),
            gamma=rl.gamma,
            lambda_returns=lambda: self._advantages(mb, values0, rl.lam_critic, None).returns_bt,
            **self.target_kwargs,
        )
        return dict(mb, targets=targets, old_values=values0["values"]), metrics

    def policy_logp(self, policy: Params, batch) -> jax.Array:
        """[B, T] log-probs of the batch's tokens under `policy`, no gradient."""
        model = self.policy_def.bind(policy)
        fn = lambda mb: P.policy_pass(model, mb, replay=self.rl.routing_replay)["logp"]
        out = P.map_microbatches(fn, batch, self.rl.microbatches, self.sharder)
        return jax.lax.stop_gradient(out)

    def _token_probe(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """What the policy loss of this update sees per token, no gradient, [B, T] each
        (0 off action tokens): `log_ratio` = log pi(policy in `state`) - rollout_logp (the
        log r that dis / estr compare with their bands, and icepop's log k: pi_old is the
        same policy here), `entropy` of that policy, and `staleness` (policy versions).
        The token dump of sao_jax/run/token_dump.py; called before `update_step`, which
        donates the state."""
        model = self.policy_def.bind(state.policy)

        def fn(mb):
            out = P.policy_pass(model, mb, replay=self.rl.routing_replay)
            return dict(logp=out["logp"], entropy=out["entropy"])

        out = P.map_microbatches(fn, batch, self.rl.microbatches, self.sharder)
        m = batch["action_mask"]
        return dict(
            log_ratio=jnp.where(m, out["logp"] - batch["rollout_logp"], 0.0),
            entropy=jnp.where(m, out["entropy"], 0.0),
            staleness=token_staleness(state.step, batch),
        )

    def with_target_inputs(self, state: TrainState, batch):
        """The batch with what the critic target reads beyond it: for 'brace', the log
        ratio of the policy at the start of the update to the rollout engine, per token."""
        if not self.target_entry.needs_log_ratio:
            return batch
        log_ratio_bt = self.policy_logp(state.policy, batch) - batch["rollout_logp"]
        return dict(batch, target_log_ratio=jnp.where(batch["action_mask"], log_ratio_bt, 0.0))

    def _first_critic_grads(self, params, batch, n_tok):
        """The first critic step's loss, gradients and metrics, and V0 and the targets from
        that step's own forward: per microbatch, forward with `jax.vjp`, targets from its
        values (rows are independent), then the loss's cotangent pulled back. Microbatch
        sums in the order of `passes.accumulate_grads`."""

        def one(mb):
            def forward(p):
                out = self._critic_forward(p, mb)
                return dict(values=out["values"], aux_loss=out["aux_loss"]), out["bootstrap"]

            out, pullback, bootstrap = jax.vjp(forward, params, has_aux=True)
            values0 = jax.lax.stop_gradient(dict(values=out["values"], bootstrap=bootstrap))
            mb, target_metrics = self._critic_targets(mb, values0)
            (loss, metrics), d_out = jax.value_and_grad(
                lambda o: self._critic_loss(o, mb, n_tok), has_aux=True
            )(out)
            sums = (loss, pullback(d_out)[0], metrics, target_metrics)
            return sums, (values0, mb["targets"])

        num = self.rl.microbatches
        if num == 1:
            (loss, grads, metrics, target_metrics), (values0, targets) = one(batch)
            return loss, grads, metrics, target_metrics, values0, targets

        def body(acc, mb):
            sums, per_mb = one(mb)
            return jax.tree.map(jnp.add, acc, sums), per_mb

        mbs = P.split_microbatches(batch, num, self.sharder)
        shapes = jax.eval_shape(lambda: one(jax.tree.map(lambda x: x[0], mbs))[0])
        (loss, grads, metrics, target_metrics), per_mb = jax.lax.scan(
            body, jax.tree.map(jnp.zeros_like, shapes), mbs
        )
        values0, targets = P.merge_microbatches(per_mb, self.sharder)
        return loss, grads, metrics, target_metrics, values0, targets

    def _critic_update(self, params, opt, loss, grads, metrics):
        updates, opt = self.critic_tx.update(grads, opt, params)
        params = apply_updates(params, updates, self.critic_frozen)
        ok = jnp.isfinite(loss) & _all_finite(grads)
        metrics = dict(metrics, **rm.step_metrics(loss, grads, self.critic_clip))
        return params, opt, ok, metrics

    def critic_steps(self, critic, copt, batch, values0, n_tok):
        """K optimizer steps on the value MSE against fixed targets from V0.

        values0 None (the default): V0 comes from the first step's own forward, and the
        other K - 1 steps follow in a scan. Given values0 (`initial_values`): the K steps
        in one scan. Returns a `CriticRun`.
        """
        rl = self.rl

        def one_step(carry, mb_batch):
            params, opt = carry
            loss, grads, metrics = P.accumulate_grads(
                lambda p, mb: self._critic_loss(self._critic_forward(p, mb), mb, n_tok),
                params,
                mb_batch,
                rl.microbatches,
                self.sharder,
            )
            params, opt, ok, metrics = self._critic_update(params, opt, loss, grads, metrics)
            return (params, opt), (ok, metrics)

        if values0 is None:
            out = self._first_critic_grads(critic, batch, n_tok)
            loss, grads, metrics, target_metrics, values0, targets = out
            critic, copt, ok, metrics = self._critic_update(critic, copt, loss, grads, metrics)
            mb_batch = dict(batch, targets=targets, old_values=values0["values"])
            (critic, copt), rest = jax.lax.scan(
                lambda c, _: one_step(c, mb_batch), (critic, copt), None, length=rl.k_critic - 1
            )
            stack = lambda a, b: jnp.concatenate([a[None], b])
            oks, per_step = jax.tree.map(stack, (ok, metrics), rest)
        else:
            mb_batch, target_metrics = self._critic_targets(batch, values0)
            targets = mb_batch["targets"]
            (critic, copt), (oks, per_step) = jax.lax.scan(
                lambda c, _: one_step(c, mb_batch), (critic, copt), None, length=rl.k_critic
            )
        # Report the first and last of the K steps' metrics.
        first = jax.tree.map(lambda x: x[0], per_step)
        last = jax.tree.map(lambda x: x[-1], per_step)
        metrics = {**rm.prefixed("critic_first", first), **rm.prefixed("critic", last)}
        metrics |= rm.prefixed("critic", target_metrics)
        return CriticRun(critic, copt, jnp.all(oks), metrics, targets, values0)

    def policy_step(self, state: TrainState, batch, advantages_bt, n_tok, key):
        """The policy's optimizer steps on one batch; metrics pooled over them.

        rl.ppo_epochs = rl.minibatches = 1 (SAO's DIS): one step on the whole batch.
        Otherwise `rl.ppo_epochs` passes, each a fresh permutation of the rows (drawn from
        `key`) cut into `rl.minibatches` minibatches, one optimizer step per minibatch,
        all in one lax.scan: the loop of veRL / OpenRLHF. ppo_clip and dis compare with
        the rollout engine's log-probs (the behaviour policy), so from the second step on
        (and on stale data from the first) their ratios leave 1 and the clip binds.
        icepop's pi_old is the policy at the start of the step, fixed through the steps.
        Each minibatch loss is a token mean over that minibatch.
        """
        rl = self.rl
        mb_batch = dict(batch, advantages=advantages_bt)
        mb_batch["staleness"] = token_staleness(state.step, batch)
        if self.loss_entry.needs_old_logp:  # pi_old = the policy at the start of the step
            mb_batch["old_logp"] = self.policy_logp(state.policy, batch)
        if rl.ppo_epochs * rl.minibatches == 1:
            policy, opt, ok, metrics = self._policy_update(
                state.policy, state.policy_opt, mb_batch, n_tok
            )
            return policy, opt, ok, rm.prefixed("policy", metrics)

        rows = batch["tokens"].shape[0]
        idx_sr = minibatch_indices(key, rows, rl.ppo_epochs, rl.minibatches)  # [E*M, B/M]

        def one_step(carry, idx_r):
            params, opt = carry
            take = lambda x: self.sharder.constrain(
                jnp.take(x, idx_r, axis=0), ("batch",) + (None,) * (x.ndim - 1)
            )
            mb = jax.tree.map(take, mb_batch)
            n_mb = jnp.maximum(jnp.sum(mb["action_mask"]), 1).astype(jnp.float32)
            params, opt, ok, metrics = self._policy_update(params, opt, mb, n_mb)
            return (params, opt), (ok, metrics)

        (policy, opt), (oks, per_step) = jax.lax.scan(
            one_step, (state.policy, state.policy_opt), idx_sr
        )
        metrics = jax.tree.map(lambda x: jnp.sum(x, axis=0), per_step)  # (sum, count) pooled
        return policy, opt, jnp.all(oks), rm.prefixed("policy", metrics)

    def _policy_update(self, params, opt, mb_batch, n_tok):
        """One policy optimizer step on `mb_batch` (gradients accumulated over
        rl.microbatches), its loss a token mean with denominator `n_tok`."""
        rl = self.rl

        def loss_fn(params, mb):
            out = P.policy_pass(self.policy_def.bind(params), mb, replay=rl.routing_replay)
            loss, metrics = losses.policy_loss(
                rl.policy_loss,
                logp_bt=out["logp"],
                rollout_logp_bt=mb["rollout_logp"],
                advantages_bt=mb["advantages"],
                action_mask_bt=mb["action_mask"],
                old_logp_bt=mb.get("old_logp"),
                entropy_bt=out["entropy"],
                staleness_bt=mb["staleness"],
                denominator=n_tok,
                **self.loss_kwargs,
            )
            m = mb["action_mask"]
            metrics = dict(metrics, entropy=rm.masked_sum_count(out["entropy"], m))
            metrics["logp_gap"] = rm.masked_sum_count(out["logp"] - mb["rollout_logp"], m)
            return loss + out["aux_loss"] / rl.microbatches, metrics

        loss, grads, metrics = P.accumulate_grads(
            loss_fn, params, mb_batch, rl.microbatches, self.sharder
        )
        updates, opt = self.policy_tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ok = jnp.isfinite(loss) & _all_finite(grads)
        metrics = dict(metrics, **rm.step_metrics(loss, grads, self.policy_clip))
        return params, opt, ok, metrics

    def _update_step(self, state: TrainState, batch, key):
        rl = self.rl  # `key` shuffles the minibatches of the PPO loop (policy_step)
        n_tok = jnp.maximum(jnp.sum(batch["action_mask"]), 1).astype(jnp.float32)
        critic, copt, ok_c, metrics = state.critic, state.critic_opt, jnp.array(True), {}
        values = critic_run = None
        lr_metrics = {"policy/lr": rm.one(self.policy_lr(update_count(state.policy_opt)))}
        if self.uses_critic:  # K critic steps; V0 from the first one's forward
            critic_run = self.critic_steps(
                critic,
                copt,
                self.with_target_inputs(state, batch),
                self.initial_values(critic, batch),
                n_tok,
            )
            values = critic_run.values0
            lr_metrics["critic/lr"] = rm.one(self.critic_lr(update_count(state.critic_opt)))
            mc_bt = gae.monte_carlo_returns(batch["rewards"], batch["action_mask"], rl.gamma)
            ev_pre = self._honest_ev(values, mc_bt, batch)
            jumps = value_jumps.value_jump_metrics(
                values["values"], batch["action_mask"], mc_bt, batch["outcome"]
            )
        if self.uses_critic and rl.order == "critic_first":
            critic, copt, ok_c = critic_run.critic, critic_run.critic_opt, critic_run.ok
            metrics = critic_run.metrics
            values = self.critic_values(critic, batch)
            metrics["critic/ev_post_update"] = self._honest_ev(values, mc_bt, batch)
        adv = self._advantages(batch, values, self._policy_lambda(batch), state.baseline)
        advantages_bt = adv.advantages_bt
        if rl.whiten_advantages:
            advantages_bt = adv_lib.whiten_advantages(advantages_bt, batch["action_mask"])
        policy, popt, ok_p, pmetrics = self.policy_step(state, batch, advantages_bt, n_tok, key)
        if self.uses_critic and rl.order == "policy_first":  # computed above, from V0
            critic, copt, ok_c = critic_run.critic, critic_run.critic_opt, critic_run.ok
            metrics = critic_run.metrics
        metrics = {**metrics, **pmetrics, **rm.prefixed("adv", adv.metrics), **lr_metrics}
        if self.uses_critic:
            metrics["critic/ev_pre_update"] = ev_pre
            metrics |= rm.prefixed("obs", jumps)
        if values is not None:
            metrics["critic/value"] = rm.masked_sum_count(values["values"], batch["action_mask"])
        new = state.replace(
            step=state.step + 1,
            policy=policy,
            critic=critic,
            policy_opt=popt,
            critic_opt=copt,
            baseline=adv.baseline_state,
        )
        return self._guard(state, new, ok_c & ok_p, metrics, batch)

    def _honest_ev(self, values, mc_bt, batch):
        return rm.one(rm.explained_variance(values["values"], mc_bt, batch["action_mask"]))

    def _value_step(self, state: TrainState, batch, key):
        """Critic-only RL step (rl.critic_only_steps); the policy is untouched."""
        del key
        if not self.uses_critic:
            return state.replace(updates=state.updates + 1), {}
        n_tok = jnp.maximum(jnp.sum(batch["action_mask"]), 1).astype(jnp.float32)
        values = self.initial_values(state.critic, batch)
        mc_bt = gae.monte_carlo_returns(batch["rewards"], batch["action_mask"], self.rl.gamma)
        lr = rm.one(self.critic_lr(update_count(state.critic_opt)))
        run = self.critic_steps(
            state.critic, state.critic_opt, self.with_target_inputs(state, batch), values, n_tok
        )
        metrics = {**run.metrics, "critic/lr": lr}
        metrics["critic/ev_pre_update"] = self._honest_ev(run.values0, mc_bt, batch)
        new = state.replace(critic=run.critic, critic_opt=run.critic_opt)
        return self._guard(state, new, run.ok, metrics, batch)

    def _guard(self, old: TrainState, new: TrainState, ok, metrics, batch):
        """Keep `new` if everything was finite, else `old`; count skips either way."""
        state = _select(ok, new, old)
        skipped = (~ok).astype(jnp.int32)
        state = state.replace(
            updates=old.updates + 1,
            skipped_steps=old.skipped_steps + skipped,
            consecutive_skips=jnp.where(ok, 0, old.consecutive_skips + 1),
        )
        metrics = dict(metrics)
        metrics["skipped"] = rm.one(skipped)
        outcome_b = batch["outcome"]
        metrics["batch/outcome"] = rm.masked_sum_count(outcome_b, jnp.ones_like(outcome_b))
        metrics["batch/action_tokens"] = rm.one(jnp.sum(batch["action_mask"]))
        return state, metrics
