"""The compiled update step at T = 4096 holds no [T, T] and no [T, V] float32 buffer.

Compiled from shapes only (nothing runs). The tiny model's vocabulary is set to 80 so
that V differs from every other dimension (D = F = 64), which makes a [.., T, V] shape
unambiguous. A negative control shows the check sees the naive kernel's [T, T] scores.
"""

import math

from configs import base
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, policy_def
from sao_jax.parallel.mesh import Sharder
from sao_jax.plan.step_memory import buffer_shapes, compile_update_step
from sao_jax.rl.update import Learner

V = 80


def _shapes(length: int, rl=None, **model):
    c = base.get_config()
    c.model.update(vocab_size=V, **model)
    c.rl.update(rl or {})
    c.rl.batch_size = 1
    c = config_lib.validate(c)
    cfg = ModelConfig.from_config(c.model)
    sharder = Sharder()
    learner = Learner(c.rl, c.optim, policy_def(cfg, sharder), critic_def(cfg, sharder), sharder)
    return buffer_shapes(compile_update_step(learner, cfg, 1, length, fast=True))


def _quadratic(shapes, t, *, by_size=False):
    """Shapes with two dimensions of length T (or, `by_size`, at least T x T elements)."""
    return sorted(s for s in shapes if s[1].count(t) >= 2 or (by_size and math.prod(s[1]) >= t * t))


def _logits(shapes, t):
    return sorted(s for s in shapes if s[0] == "f32" and t in s[1] and V in s[1])


def test_update_step_at_4k_has_no_quadratic_or_vocab_buffer():
    t = 4096
    shapes = _shapes(t)  # the defaults: auto attention (blockwise on CPU), chunked LM head
    assert any(t in dims for _, dims in shapes)  # the program does hold [.., T, ..] arrays
    assert _quadratic(shapes, t, by_size=True) == []
    assert _logits(shapes, t) == []


def test_check_sees_naive_scores_and_whole_logits():
    """Negative control at T = 1024 (two 512-blocks): naive attention and an unchunked LM
    head do hold [.., T, T] scores and [.., T, V] logits, and the check finds them. The
    update step without a critic (a moving-average baseline): the policy's half holds both
    buffers, and the step compiles in about half the time."""
    t = 1024
    shapes = _shapes(t, {"advantage": "moving_average"}, attention_impl="naive", logits_chunk=0)
    assert _quadratic(shapes, t) and _logits(shapes, t)
