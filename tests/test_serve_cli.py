"""`python -m experiments.serve` as a process (the contract's mechanism): gateway.json once
it accepts connections, the admin routes answer, SIGTERM ends it with exit status 0 and
its live session written as dropped; a bad config field exits 2 in one line."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.serve_support import episodes, http

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.sampling.num_slots=2", "--config.sampling.max_len=512"]


def _serve(workdir, *extra):
    cmd = [sys.executable, "-m", "experiments.serve", "--config=configs/harness.py:smoke",
           f"--workdir={workdir}", "--port=0", *SMALL, *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def test_sigterm_exits_0_and_drops_live_sessions(tmp_path):
    proc = _serve(tmp_path)
    try:
        path = tmp_path / "gateway.json"
        deadline = time.monotonic() + 180
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert path.exists(), proc.stdout.read() if proc.poll() is not None else "no gateway.json"
        info = json.loads(path.read_text())
        assert info["pid"] == proc.pid
        status, _, models = http("GET", f"{info['base_url']}/models", key=info["api_key"])
        assert status == 200 and models["data"][0]["id"] == info["model"]
        status, _, s = http("POST", f"{info['base_url']}/sessions", {"task": 1}, info["api_key"])
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    (ep,) = episodes(tmp_path)
    assert ep["id"] == s["id"] and ep["dropped"] == "shutdown"


def test_bad_config_field_exits_2(tmp_path):
    proc = _serve(tmp_path, "--config.sampling.num_slots=0")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "num_slots" in out and "Traceback" not in out
