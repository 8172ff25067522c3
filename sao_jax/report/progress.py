"""Terminal progress of a run: a tqdm bar on a terminal, plain log lines elsewhere (CI)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import jax
import tqdm

from sao_jax.metrics import Scalar, as_scalar


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


DEFAULT_FIELDS = {
    "reward": "train/reward",
    "success": "train/success",
    "tok/s": "perf/action_tokens_per_s",
}


class Progress:
    """Step/total, chosen scalars, tokens/s and ETA: a tqdm bar on a terminal, else one
    plain log line every `every_s` seconds (and at the last step / close) for CI logs.

    fields: label -> metric name, shown when `update` was given that metric.
    Prints nothing unless `enabled` and `primary` (default: jax.process_index() == 0).
    ETA = (total - step) / rate, rate = (step - initial) / elapsed.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        desc: str = "train",
        fields: Mapping[str, str] = DEFAULT_FIELDS,
        stream: TextIO | None = None,
        tty: bool | None = None,
        every_s: float = 30.0,
        enabled: bool = True,
        primary: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not (isinstance(total, int) and total >= 0):
            raise ValueError(f"Progress: total must be an int >= 0, got {total!r}")
        if not 0 <= initial <= total:
            raise ValueError(f"Progress: initial must be in [0, total={total}], got {initial}")
        self.total, self.initial, self.step = total, initial, initial
        self.desc, self.fields, self.every_s, self._clock = desc, dict(fields), every_s, clock
        self.stream = stream if stream is not None else sys.stdout
        primary = jax.process_index() == 0 if primary is None else primary
        self.enabled = enabled and primary and total > 0  # nothing to show for 0 steps
        if tty is None:
            tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._values: dict[str, Scalar] = {}
        self._start = clock()
        self._last_line: float | None = None
        self._printed_step: int | None = None
        self._bar = None
        if self.enabled and tty:
            self._bar = tqdm.tqdm(
                total=total, initial=initial, desc=desc, file=self.stream, unit="step",
                dynamic_ncols=True,
            )  # fmt: skip

    def _postfix(self) -> str:
        parts = []
        for label, key in self.fields.items():
            if key in self._values:
                v = self._values[key]
                parts.append(f"{label} {v:.4g}" if v is not None else f"{label} nan")
        return " | ".join(parts)

    def line(self) -> str:
        """The plain progress line for the current state."""
        elapsed = self._clock() - self._start
        done = self.step - self.initial
        eta = (self.total - self.step) * elapsed / done if done > 0 and elapsed > 0 else math.inf
        pct = 100.0 * self.step / self.total
        parts = [f"{self.desc} {self.step}/{self.total} ({pct:.1f}%)", self._postfix()]
        parts += [f"elapsed {_hms(elapsed)}", f"eta {_hms(eta)}"]
        return " | ".join(p for p in parts if p)

    def update(self, step: int, scalars: Mapping[str, Any] | None = None) -> None:
        """Moves to `step` (absolute) and records the latest values of `scalars`."""
        self.step = int(step)
        for k, v in (scalars or {}).items():
            if k in self.fields.values():
                self._values[k] = as_scalar(k, v)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(self.step - self._bar.n)
            return
        now = self._clock()
        due = self._last_line is None or now - self._last_line >= self.every_s
        if due or self.step >= self.total:
            self._print(now)

    def _print(self, now: float) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._last_line, self._printed_step = now, self.step

    def close(self) -> None:
        """Closes the bar, or prints a final line if the last step was not printed."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._printed_step != self.step:
            self._print(self._clock())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
