"""Slow, literal NumPy references for the RL math, written straight from docs/method.md.

Deliberately loop-based and independent of sao_jax: the GAE reference walks the
subsequence of action tokens in the paper's form A(a_{i,N}) = delta + gamma*lam*A(a_{i+1,0})
rather than reusing the masked-carry trick.
"""

from __future__ import annotations

import collections

import numpy as np


def random_turn_mask(rng: np.random.Generator, b: int, t: int, p_empty=0.15) -> np.ndarray:
    """[B, T] bool masks laid out in turns: optional prompt, then action/observation spans.

    Rows may be empty, start with an action, end with an observation or an action, and
    have one-token actions.
    """
    mask = np.zeros((b, t), bool)
    for row in range(b):
        if rng.random() < p_empty:
            continue
        pos = int(rng.integers(0, 4))  # prompt / leading observation (may be 0 tokens)
        while pos < t:
            n_act = int(rng.integers(1, 5))
            mask[row, pos : pos + n_act] = True
            pos += n_act + int(rng.integers(1, 5))
    return mask


def fold_observation_rewards(r: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Moves each reward on a non-action token to the last action token before it."""
    out = np.where(m, r, 0.0).astype(np.float64)
    for b in range(r.shape[0]):
        last = None
        for t in range(r.shape[1]):
            if m[b, t]:
                last = t
            elif r[b, t] != 0 and last is not None:
                out[b, last] += r[b, t]
    return out


def gae_reference(r, v, m, gamma, lam_b, last_b):
    """Observation-skipping GAE: plain GAE over the compacted action tokens, scattered back."""
    r = fold_observation_rewards(np.asarray(r), np.asarray(m, bool))
    b_size, _ = r.shape
    adv = np.zeros(r.shape)
    for b in range(b_size):
        idx = np.flatnonzero(m[b])  # the action tokens, in order
        a_next = 0.0
        for i in reversed(range(len(idx))):
            t = idx[i]
            v_next = v[b, idx[i + 1]] if i + 1 < len(idx) else last_b[b]
            delta = r[b, t] + gamma * v_next - v[b, t]
            a_next = delta + gamma * lam_b[b] * a_next
            adv[b, t] = a_next
    ret = np.where(m, adv + v, 0.0)
    return adv, ret


def adaptive_lambda_reference(m, alpha):
    out = []
    for row in m:
        n = int(np.sum(row))
        out.append(0.0 if n == 0 else min(max(1.0 - 1.0 / (alpha * n), 0.0), 1.0))
    return np.array(out)


def turns_of(m_row, tid_row):
    """Lists of token indices, one per model turn (runs of action tokens with one id)."""
    turns = []
    for t in range(len(m_row)):
        if not m_row[t]:
            continue
        if turns and turns[-1][-1] == t - 1 and tid_row[t - 1] == tid_row[t]:
            turns[-1].append(t)
        else:
            turns.append([t])
    return turns


def turn_rewards_reference(turn_rewards, turn_ids, m):
    out = np.zeros(m.shape)
    for b in range(m.shape[0]):
        for turn in turns_of(m[b], turn_ids[b]):
            n = turn_ids[b, turn[-1]]
            if 0 <= n < turn_rewards.shape[1]:
                out[b, turn[-1]] = turn_rewards[b, n]
    return out


def step_gae_reference(r, v, m, turn_ids, gamma, lam_b, last_b, reduce):
    """GAE over model turns: V_n the mean / last value, r_n the turn's rewards and the
    observation rewards up to the next turn; A_n broadcast to the turn's tokens."""
    adv = np.zeros(r.shape)
    ret = np.zeros(r.shape)
    for b in range(r.shape[0]):
        turns = turns_of(m[b], turn_ids[b])
        starts = [tr[0] for tr in turns] + [r.shape[1]]
        v_n = [np.mean(v[b, tr]) if reduce == "mean" else v[b, tr[-1]] for tr in turns]
        r_n = [np.sum(r[b, starts[k] : starts[k + 1]]) for k in range(len(turns))]
        a_next = 0.0
        for k in reversed(range(len(turns))):
            v_next = v_n[k + 1] if k + 1 < len(turns) else last_b[b]
            a_next = r_n[k] + gamma * v_next - v_n[k] + gamma * lam_b[b] * a_next
            adv[b, turns[k]] = a_next
            ret[b, turns[k]] = a_next + v_n[k]
    return adv, ret


def cross_observation_reference(r, v, m, gamma, lam_b, last_b):
    """Plain per-token GAE over t <= each row's last action token, masked to actions."""
    adv = np.zeros(r.shape)
    for b in range(r.shape[0]):
        acts = np.flatnonzero(m[b])
        if len(acts) == 0:
            continue
        end = acts[-1]
        r_row = r[b].astype(np.float64).copy()
        r_row[end] += np.sum(r[b, end + 1 :])  # trailing rewards: to the last token
        a_next = 0.0
        for t in range(end, -1, -1):
            v_next = v[b, t + 1] if t < end else last_b[b]
            a_next = r_row[t] + gamma * v_next - v[b, t] + gamma * lam_b[b] * a_next
            adv[b, t] = a_next
    adv_m = np.where(m, adv, 0.0)
    return adv_m, np.where(m, adv_m + v, 0.0)


def group_reference(outcome, group_ids, valid, kind, eps=1e-6):
    """Per-row advantages of grpo / drgrpo / rloo with explicit groups (valid rows only)."""
    groups = collections.defaultdict(list)
    for i in range(len(outcome)):
        if valid[i]:
            groups[int(group_ids[i])].append(float(outcome[i]))
    out = np.zeros(len(outcome))
    for i in range(len(outcome)):
        if not valid[i]:
            continue
        g = groups[int(group_ids[i])]
        mean = sum(g) / len(g)
        if kind == "grpo":
            std = (sum((x - mean) ** 2 for x in g) / len(g)) ** 0.5
            out[i] = (outcome[i] - mean) / (std + eps)
        elif kind == "drgrpo":
            out[i] = outcome[i] - mean
        else:  # rloo
            others = list(g)
            others.remove(float(outcome[i]))
            out[i] = outcome[i] - sum(others) / len(others) if others else 0.0
    return out


class MovingAverageReference:
    """R - mean of the last `window` valid outcomes seen before this batch (0 if none)."""

    def __init__(self, window: int):
        self.history = collections.deque(maxlen=window)

    def __call__(self, outcome, valid):
        base = sum(self.history) / len(self.history) if self.history else 0.0
        adv = np.array([outcome[i] - base if valid[i] else 0.0 for i in range(len(outcome))])
        self.history.extend(float(outcome[i]) for i in range(len(outcome)) if valid[i])
        return adv, base


class KeyedMovingAverageReference:
    """Per row: R - mean of the last `window` valid outcomes of the row's own key seen
    before this batch (0 if none); one deque per key, filled row by row after the batch."""

    def __init__(self, window: int):
        self.history = collections.defaultdict(lambda: collections.deque(maxlen=window))

    def __call__(self, outcome, valid, keys):
        base = np.zeros(len(outcome))
        for i, k in enumerate(keys):
            h = self.history[int(k)]
            base[i] = sum(h) / len(h) if h else 0.0
        adv = np.array([outcome[i] - base[i] if valid[i] else 0.0 for i in range(len(outcome))])
        for i, k in enumerate(keys):
            if valid[i]:
                self.history[int(k)].append(float(outcome[i]))
        return adv, base


def dis_reference(logp, rollout_logp, adv, m, eps_l, eps_h, denom):
    """DIS loss and its gradient wrt logp, token by token."""
    loss, grad = 0.0, np.zeros(logp.shape)
    for b, t in zip(*np.nonzero(m)):
        r = np.exp(logp[b, t] - rollout_logp[b, t])
        f = r if 1 - eps_l < r < 1 + eps_h else 0.0
        loss -= f * adv[b, t] * logp[b, t] / denom
        grad[b, t] = -f * adv[b, t] / denom
    return loss, grad


def ppo_reference(logp, old_logp, adv, m, eps_low, eps_high, denom, keep=None, weight=None):
    """Clipped surrogate loss and gradient; `keep` optionally masks tokens and `weight`
    scales each token's term (IcePop: weight k inside the band, masked outside)."""
    loss, grad = 0.0, np.zeros(logp.shape)
    for b, t in zip(*np.nonzero(m)):
        if keep is not None and not keep[b, t]:
            continue
        w = 1.0 if weight is None else weight[b, t]
        rho = np.exp(logp[b, t] - old_logp[b, t])
        s1, s2 = rho * adv[b, t], np.clip(rho, 1 - eps_low, 1 + eps_high) * adv[b, t]
        loss -= w * min(s1, s2) / denom
        grad[b, t] = -w * rho * adv[b, t] / denom if s1 <= s2 else 0.0
    return loss, grad


def estr_reference(logp, rollout_logp, adv, m, entropy, tau, eps, denom):
    loss, grad = 0.0, np.zeros(logp.shape)
    for b, t in zip(*np.nonzero(m)):
        log_r = logp[b, t] - rollout_logp[b, t]
        if abs(log_r) <= np.sqrt(tau * (entropy[b, t] + eps)):
            r = np.exp(log_r)
            loss -= r * adv[b, t] * logp[b, t] / denom
            grad[b, t] = -r * adv[b, t] / denom
    return loss, grad


def value_reference(v, ret, m, old=None, clip_eps=None, denom=None):
    denom = max(int(np.sum(m)), 1) if denom is None else denom
    loss = 0.0
    for b, t in zip(*np.nonzero(m)):
        sq = (v[b, t] - ret[b, t]) ** 2
        if clip_eps is not None:
            vc = old[b, t] + np.clip(v[b, t] - old[b, t], -clip_eps, clip_eps)
            sq = max(sq, (vc - ret[b, t]) ** 2)
        loss += 0.5 * sq / denom
    return loss


def staleness_bucket(lag: int) -> str:
    if lag <= 2:
        return str(lag)
    if lag <= 4:
        return "3_4"
    if lag <= 8:
        return "5_8"
    return "gt8"


def brace_reference(r, v, m, log_ratio, gamma, last_b, k, c_bar, rho_bar, tail):
    """BRACE critic targets straight from the definition (docs/method.md section 8): on the
    compacted action tokens, y_t = V_t + sum_{j<k} gamma^j (prod_{i<j} c_{t+i}) w_{t+j}
    delta_{t+j} + tau_t * sum_{j>=k} gamma^j delta_{t+j}, double loops over t and j."""
    r = fold_observation_rewards(np.asarray(r), np.asarray(m, bool))
    out = np.zeros(r.shape)
    for b in range(r.shape[0]):
        idx = np.flatnonzero(m[b])
        n = len(idx)
        vals = [float(v[b, i]) for i in idx] + [float(last_b[b])]
        rho = [float(np.exp(np.clip(log_ratio[b, i], -20.0, 20.0))) for i in idx]
        delta = [r[b, idx[i]] + gamma * vals[i + 1] - vals[i] for i in range(n)]
        for t in range(n):
            y, trace = vals[t], 1.0
            for j in range(n - t):
                if j < k:
                    y += gamma**j * trace * min(rho_bar, rho[t + j]) * delta[t + j]
                    trace *= min(c_bar, rho[t + j])
            tail_w = 1.0
            if tail == "trace":
                tail_w = float(np.prod([min(c_bar, rho[t + i]) for i in range(min(k, n - t))]))
            for j in range(k, n - t):
                y += tail_w * gamma**j * delta[t + j]
            out[b, idx[t]] = y
    return out
