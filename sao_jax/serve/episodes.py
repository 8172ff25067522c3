"""`DIR/episodes.jsonl`: one JSON line per finished or dropped episode, written whole.

`write` returns once its line is on disk (written, flushed and fsynced), so a reply sent
after it never names an episode a crash could lose. Concurrent writers commit as a group:
the first to find no write in progress writes every line queued so far in one `write`
call and one fsync while the others wait for it (32 reward posts at once cost a few
fsyncs, not 32 in a row: experiments/bench/gateway.py's round tail). Lines are whole and
never interleave. A failed commit raises its error in every writer whose line it held
(those lines are not written; the next commit goes on with the lines queued since), so
each caller either returns with its line on disk or raises. `on_episode` (optional)
sees each record after its line is on disk (the trainer's queue, tests).
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
from collections.abc import Callable
from typing import Any


class EpisodeLog:
    def __init__(self, path: str | pathlib.Path, on_episode: Callable[[dict], None] | None = None):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self._queue: list[str] = []  # lines not yet committed, in arrival order
        self._queued = 0  # lines ever queued; a line's ticket is its number, from 1
        self._done = 0  # tickets 1.._done are committed (on disk) or failed
        self._failed: list[tuple[int, int, BaseException]] = []  # (first, last, error)
        self._committing = False  # a writer is writing a batch (outside the lock)
        self._on_episode = on_episode
        self.written = 0
        self.dropped = 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"  # whole, one line
        with self._cond:
            self._queue.append(line)
            self._queued += 1
            ticket = self._queued
            while self._done < ticket:
                if self._committing:
                    self._cond.wait()
                else:
                    self._commit()
            for first, last, error in self._failed:
                if first <= ticket <= last:
                    raise error
            self.written += 1
            self.dropped += record.get("dropped") is not None
        if self._on_episode is not None:
            self._on_episode(record)

    def _commit(self) -> None:
        """Writes every queued line in one call and one fsync; called holding the lock,
        which it releases while writing."""
        batch, self._queue = self._queue, []
        first = self._done + 1
        self._committing = True
        self._cond.release()
        error = None
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(batch))
                f.flush()
                os.fsync(f.fileno())
        except Exception as e:  # each writer of the batch raises it
            error = e
        finally:
            self._cond.acquire()
        if error is not None:
            self._failed.append((first, first + len(batch) - 1, error))
        self._done += len(batch)
        self._committing = False
        self._cond.notify_all()
