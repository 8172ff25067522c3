"""Per-token dumps of chosen RL steps: what the policy loss saw on every action token.

`train.token_dump_steps = (n, ...)` makes the RL loop (sao_jax/train.py) write, for the
update logged as step n (the batch it trained on, and the policy before it, version
n - 1), one file `<workdir>/token_dump/step=<n>.npz` holding over the batch's action
tokens, in row-major order:

  log_ratio [N] float32   log pi_{n-1}(a_t) - rollout_logp(a_t): the log r of dis / estr
                          and icepop's log k (its pi_old is the same policy)
  entropy   [N] float32   the entropy of pi_{n-1} at the token (nats)
  staleness [N] int32     policy versions between the token's sampler and pi_{n-1}

A mask rule's parameter can then be calibrated from data to mask a chosen fraction of
those tokens (sao_jax/rl/mask_budget.py, experiments/mask_budget/). The probe is one
extra policy forward per dumped step (Learner.token_probe); other steps are untouched.
One process only: the arrays are read whole on the host.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterable, Mapping

import numpy as np

from sao_jax.schema import ConfigError

DUMP_DIR = "token_dump"  # <workdir>/token_dump/step=<n>.npz
FIELDS = ("log_ratio", "entropy", "staleness")


def path(workdir: str | pathlib.Path, step: int) -> pathlib.Path:
    return pathlib.Path(workdir) / DUMP_DIR / f"step={int(step)}.npz"


def write(
    workdir: str | pathlib.Path, step: int, probe: Mapping[str, np.ndarray], action_mask_bt
) -> pathlib.Path:
    """Saves the action tokens of `probe` ([B, T] arrays: FIELDS) for `step`."""
    m_bt = np.asarray(action_mask_bt, bool)
    out = {
        "log_ratio": np.asarray(probe["log_ratio"], np.float32)[m_bt],
        "entropy": np.asarray(probe["entropy"], np.float32)[m_bt],
        "staleness": np.asarray(probe["staleness"], np.int32)[m_bt],
    }
    p = path(workdir, step)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp.npz")
    np.savez(tmp, **out)
    tmp.replace(p)  # whole or absent: a resumed run rewrites it
    return p


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Action tokens of one or more dumped steps, concatenated ([N] each)."""

    log_ratio: np.ndarray
    entropy: np.ndarray
    staleness: np.ndarray

    @property
    def size(self) -> int:
        return int(self.log_ratio.size)


def read(workdirs: Iterable[str | pathlib.Path], steps: Iterable[int]) -> Tokens:
    """The tokens of `steps` of every workdir, concatenated (workdir-major); a missing
    or malformed file raises ConfigError naming it."""
    parts: dict[str, list[np.ndarray]] = {f: [] for f in FIELDS}
    for workdir in workdirs:
        for step in steps:
            p = path(workdir, step)
            if not p.is_file():
                raise ConfigError(
                    f"token dump {p}: missing (the run needs train.token_dump_steps "
                    f"including {step} and must have reached that step)"
                )
            with np.load(p) as z:
                missing = [f for f in FIELDS if f not in z.files]
                if missing:
                    raise ConfigError(f"token dump {p}: no arrays {missing}")
                arrays = [z[f] for f in FIELDS]
            if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
                raise ConfigError(
                    f"token dump {p}: expected 1-D arrays of one length, got "
                    f"{[a.shape for a in arrays]}"
                )
            for f, a in zip(FIELDS, arrays, strict=True):
                parts[f].append(a)
    if not parts["log_ratio"]:
        raise ConfigError("token dump: no workdirs or no steps given")
    return Tokens(*(np.concatenate(parts[f]) for f in FIELDS))
