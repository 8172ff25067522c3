"""`DIR/episodes.jsonl`: one JSON line per finished or dropped episode, written whole.

Each line is written with one `write` call under a lock and flushed, so a reader never
sees half an episode and lines of concurrent sessions never interleave. `on_episode`
(optional) sees each record too (the trainer's queue, tests).
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
        self._lock = threading.Lock()
        self._on_episode = on_episode
        self.written = 0
        self.dropped = 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"  # whole, one line
        with self._lock:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.written += 1
            self.dropped += record.get("dropped") is not None
        if self._on_episode is not None:
            self._on_episode(record)
