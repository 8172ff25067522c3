"""Learner variants the tests use (kept out of the library): one that counts how often
its jitted steps trace, and the earlier separate V0 pass."""

from __future__ import annotations

import collections

from sao_jax.rl.update import Learner


class CountingLearner(Learner):
    """A Learner whose `traces` counts the traces of update_step and value_step (Python
    side effects run once per trace, never when a compiled step runs)."""

    def __init__(self, *args, **kwargs):
        self.traces = collections.Counter({"update_step": 0, "value_step": 0})
        super().__init__(*args, **kwargs)

    def _update_step(self, state, batch, key):
        self.traces["update_step"] += 1
        return super()._update_step(state, batch, key)

    def _value_step(self, state, batch, key):
        self.traces["value_step"] += 1
        return super()._value_step(state, batch, key)


class SeparateV0Learner(Learner):
    """V0 by its own critic forward before the K critic steps (the form before V0 came from
    the first critic step's forward; the same results bit for bit)."""

    def initial_values(self, critic, batch):
        return self.critic_values(critic, batch)
