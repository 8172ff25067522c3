"""The privileged critic (rl.privileged_critic): the critic reads the task's hint in place
of the prompt text it names; the policy never does. Literal token substitution, the
batch fields (padded and packed), and the model passes each reading its own tokens."""

import dataclasses

import jax
import numpy as np
import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl import passes as P
from sao_jax.rl.batch import check_batch
from sao_jax.sampling.trajectory import pack_batch, pad_batch, privileged_tokens
from sao_jax.text.tokenizer import CharTokenizer
from tests.test_packing import _config, random_trajectories

TOK = CharTokenizer()


def _hinted(tr, prompt_text: str, hint):
    """`tr` with `prompt_text` as its first tokens and `hint` in its last turn's info
    (digits: ids inside the test model's vocabulary of 32)."""
    ids = np.asarray(TOK.encode(prompt_text), np.int32)
    first_action = int(np.argmax(tr.action_mask))
    n = min(len(ids), first_action)
    tokens = tr.tokens.copy()
    tokens[:n] = ids[:n]
    info = {"turn_infos": [{"critic_hint": hint}]} if hint is not None else {}
    return dataclasses.replace(tr, tokens=tokens, info=info)


def test_privileged_tokens_replace_the_first_occurrence_in_the_prompt_only():
    tr = random_trajectories(1, 0)[0]
    tr = dataclasses.replace(
        tr,
        tokens=np.asarray(TOK.encode("u3:a:b\nxx:yy"), np.int32),
        action_mask=np.array([False] * 7 + [True] * 5),
        rollout_logp=np.zeros(12, np.float32),
        sampled_logp=np.zeros(12, np.float32),
        versions=np.zeros(12, np.int32),
        turn_ids=np.array([-1] * 7 + [0] * 5, np.int32),
        turn_rewards=np.ones(1, np.float32),
        info={"turn_infos": [{"critic_hint": (":", "!")}]},
    )
    got = privileged_tokens(tr, TOK.encode)
    assert TOK.decode(got) == "u3!a:b\nxx:yy"  # the prompt's first ':', not the action's
    assert TOK.decode(tr.tokens) == "u3:a:b\nxx:yy"  # the trajectory is left as it was
    with pytest.raises(ValueError, match="no info\\['critic_hint'\\]"):
        privileged_tokens(dataclasses.replace(tr, info={}), TOK.encode)
    with pytest.raises(ValueError, match="same number of tokens"):
        privileged_tokens(
            dataclasses.replace(tr, info={"turn_infos": [{"critic_hint": (":", "!!")}]}),
            TOK.encode,
        )
    with pytest.raises(ValueError, match="not in its prompt"):
        privileged_tokens(
            dataclasses.replace(tr, info={"turn_infos": [{"critic_hint": ("?", "!")}]}),
            TOK.encode,
        )


def test_a_hint_can_apply_at_every_occurrence():
    tr = random_trajectories(1, 0)[0]
    tokens = np.asarray(TOK.encode("u3:a b\nx y z"), np.int32)
    tr = dataclasses.replace(
        tr,
        tokens=tokens,
        action_mask=np.array([False] * 7 + [True] * 5),
        rollout_logp=np.zeros(12, np.float32),
        sampled_logp=np.zeros(12, np.float32),
        versions=np.zeros(12, np.int32),
        turn_ids=np.array([-1] * 7 + [0] * 5, np.int32),
        turn_rewards=np.ones(1, np.float32),
        info={"turn_infos": [{"critic_hint": (" ", "7", "all")}]},
    )
    assert TOK.decode(privileged_tokens(tr, TOK.encode)) == "u3:a7b\nx7y7z"
    bad = dataclasses.replace(tr, info={"turn_infos": [{"critic_hint": (" ", "7", "everywhere")}]})
    with pytest.raises(ValueError, match="'prompt' or 'all'"):
        privileged_tokens(bad, TOK.encode)


def test_batches_carry_critic_tokens_padded_and_packed():
    trajs = [_hinted(t, "1", ("1", "2")) for t in random_trajectories(8, 1)]
    critic = [privileged_tokens(t, TOK.encode) for t in trajs]
    padded = pad_batch(trajs, length=32, num_rows=10, critic_tokens=critic)
    check_batch(padded)
    for i, (t, c) in enumerate(zip(trajs, critic, strict=True)):
        np.testing.assert_array_equal(padded["critic_tokens"][i, : t.length], c)
        np.testing.assert_array_equal(padded["tokens"][i, : t.length], t.tokens)
    np.testing.assert_array_equal(padded["critic_tokens"][8:], padded["tokens"][8:])  # padding
    packed, placements = pack_batch(trajs, length=32, critic_tokens=critic)
    check_batch(packed)
    for p in placements:
        sl = slice(p.start, p.start + p.length)
        np.testing.assert_array_equal(packed["packed_critic_tokens"][p.row, sl], critic[p.index])
    with pytest.raises(ValueError, match="one array per trajectory"):
        pad_batch(trajs, length=32, critic_tokens=critic[:-1])


def test_the_critic_reads_its_tokens_and_the_policy_reads_the_rollout():
    config = _config()
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=0)
    policy = models.policy_def.bind(models.policy)
    # a critic with a random value head (init: 0), so that values depend on the tokens
    leaves, treedef = jax.tree.flatten(models.critic)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    critic = models.critic_def.bind(jax.tree.unflatten(treedef, noisy))
    trajs = [_hinted(t, "1", ("1", "2")) for t in random_trajectories(8, 2)]
    critic_ids = [privileged_tokens(t, TOK.encode) for t in trajs]
    plain = pad_batch(trajs, length=32)
    hinted = pad_batch(trajs, length=32, critic_tokens=critic_ids)
    swapped = dict(plain, tokens=hinted["critic_tokens"])  # the critic's view as tokens
    # each pass jitted (one program per batch layout, not hundreds of op-by-op ones)
    values = jax.jit(lambda b: P.critic_pass(critic, b)["values"])
    logp = jax.jit(lambda b: P.policy_pass(policy, b, replay=False)["logp"])
    got = values(hinted)
    np.testing.assert_array_equal(got, values(swapped))
    assert np.abs(got - values(plain)).max() > 1e-3  # hint read
    np.testing.assert_array_equal(logp(hinted), logp(plain))  # the policy never sees it
    packed, _ = pack_batch(trajs, length=32, critic_tokens=critic_ids)
    real = hinted["segment_ids"] > 0  # packed values are 0 on padding, which nothing reads
    np.testing.assert_allclose(values(packed)[real], got[real], atol=2e-5)
