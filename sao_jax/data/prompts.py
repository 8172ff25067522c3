"""Prompt sources on grain: deterministic, seeded, with train/eval splits that never meet.

Item `i` of a source is generated from `np.random.default_rng((seed, i, split))` alone, so
any index can be produced in any order (grain's random access) and a restored iterator
continues with exactly the items it would have produced. A prompt belongs to the eval
split iff a stable hash of its uid falls below `eval_fraction` (`split_of`); generation
redraws until the prompt is in the requested split, so train and eval are disjoint for
every seed and every source built on the same `eval_fraction`.

    ds = prompt_source("arithmetic", "train", seed=0, n_ops=2)   # grain.MapDataset
    it = iter(ds.to_iter_dataset()); prompt = next(it)
    state = it.get_state(); ...; it.set_state(state)              # checkpointing

Train sources are shuffled and repeated (infinite); eval sources hold `size` distinct
prompts in a fixed order, once.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import grain
import numpy as np

from sao_jax.envs.base import Prompt
from sao_jax.envs.registry import RegistryError, get_task

SPLITS = ("train", "eval")
DEFAULT_TRAIN_SIZE = 1 << 20  # distinct indices per epoch of a train source
DEFAULT_EVAL_SIZE = 256
_MAX_DRAWS = 1000  # redraws per item before giving up on a split


def split_of(uid: str, eval_fraction: float = 0.1) -> str:
    """'eval' iff sha256(uid) / 2**64 < eval_fraction (first 8 bytes), else 'train'."""
    h = int.from_bytes(hashlib.sha256(uid.encode("utf-8")).digest()[:8], "big")
    return "eval" if h / 2.0**64 < eval_fraction else "train"


def prompt_sampler(env_name: str, **params: Any):
    """`sample(rng) -> Prompt` of a registered task's built-in prompts; params set the
    difficulty (each task's `task_prompts` in its module lists them)."""
    try:
        task = get_task(env_name)
    except RegistryError as e:
        raise ValueError(f"prompt_source: {e}") from None
    if task.prompts is None:
        raise ValueError(
            f"prompt_source: task {task.name!r} has no built-in prompts; give a dataset "
            "(config data.train)"
        )
    return task.prompts(**params)


def generate_prompt(
    sample, index: int, *, seed: int, split: str, eval_fraction: float = 0.1
) -> Prompt:
    """Item `index`: the first draw of rng((seed, index, split)) that lands in `split`."""
    rng = np.random.default_rng((seed, index, SPLITS.index(split)))
    for _ in range(_MAX_DRAWS):
        prompt = sample(rng)
        if split_of(prompt.uid, eval_fraction) == split:
            return prompt
    raise ValueError(
        f"prompt_source: no {split!r} prompt in {_MAX_DRAWS} draws (eval_fraction="
        f"{eval_fraction}); the problem space is too small for this split"
    )


def prompt_source(
    env_name: str,
    split: str,
    *,
    seed: int = 0,
    size: int | None = None,
    eval_fraction: float = 0.1,
    **params: Any,
) -> grain.MapDataset:
    """A grain MapDataset of Prompt from the built-in generator of task `env_name`.

    Args:
      split: "train" (shuffled with `seed`, repeated forever) or "eval" (`size` distinct
        prompts, default DEFAULT_EVAL_SIZE, one pass).
      seed: generation and shuffle seed.
      size: train: indices per epoch (default DEFAULT_TRAIN_SIZE); eval: prompt count.
      eval_fraction: share of the problem space (by uid hash) held out for eval.
      **params: difficulty (arithmetic: n_ops, operand_range, ops, parens; style: n_topics).
    """
    if split not in SPLITS:
        raise ValueError(f"prompt_source split={split!r}: one of {SPLITS}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"prompt_source eval_fraction={eval_fraction}: must be in (0, 1)")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"prompt_source seed={seed!r}: must be an int >= 0")
    if size is not None and size < 1:
        raise ValueError(f"prompt_source size={size}: must be >= 1")
    sample = prompt_sampler(env_name, **params)
    make = functools.partial(
        generate_prompt, sample, seed=seed, split=split, eval_fraction=eval_fraction
    )
    if split == "train":
        n = DEFAULT_TRAIN_SIZE if size is None else size
        return grain.MapDataset.range(n).map(make).shuffle(seed=seed).repeat()
    return grain.MapDataset.source(_distinct(make, DEFAULT_EVAL_SIZE if size is None else size))


def _distinct(make, size: int) -> list[Prompt]:
    """The first `size` distinct prompts (by uid) of make(0), make(1), ...; fewer if the
    space runs out within 20 * size indices (never empty)."""
    seen: dict[str, Prompt] = {}
    for i in range(20 * size):
        if len(seen) == size:
            break
        prompt = make(i)
        seen.setdefault(prompt.uid, prompt)
    return list(seen.values())


def prompt_iterator(env_name: str, split: str, **kwargs: Any) -> grain.DatasetIterator:
    """iter(prompt_source(...).to_iter_dataset()); has get_state()/set_state()."""
    return iter(prompt_source(env_name, split, **kwargs).to_iter_dataset())
