"""LLM judge client against a fake OpenAI-compatible server on loopback."""

import contextlib
import http.server
import json
import threading
import time

import pytest

from sao_jax.envs import llm_judge as J
from sao_jax.envs import style as S

GOOD = json.dumps({"quality": 1, "style": 0})


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass

    def do_POST(self):
        server = self.server
        mode = self.path.split("/")[1]
        with server.lock:
            server.hits[mode] = server.hits.get(mode, 0) + 1
            hit = server.hits[mode]
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            code, payload = self._reply(mode, hit)
        finally:
            # Leave the in-flight count before the reply goes out: the client frees its slot
            # once it has read the reply, and its next request may reach this server before
            # this handler thread runs again.
            with server.lock:
                server.in_flight -= 1
        self._send(code, payload)

    def _reply(self, mode, hit):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path.endswith("/v1/chat/completions")
        assert body["model"] == "judge" and body["messages"][0]["role"] == "system"
        self.server.requests.append(body)
        if mode == "slow":
            time.sleep(1.0)
        if mode == "busy":
            time.sleep(0.1)
        if mode == "flaky" and hit <= 2:
            return 500, b"oops"
        if mode == "missing":
            return 404, b"no such model"
        content = {"garbage": "I think it is great!", "fenced": f"```json\n{GOOD}\n```"}
        reply = {"choices": [{"message": {"role": "assistant", "content": GOOD}}]}
        reply["choices"][0]["message"]["content"] = content.get(mode, GOOD)
        return 200, (b"not json" if mode == "badbody" else json.dumps(reply).encode())

    def _send(self, code, payload):
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # client timed out
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.lock, srv.hits, srv.requests = threading.Lock(), {}, []
    srv.in_flight = srv.max_in_flight = 0
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def _judge(server, mode, **kw):
    url = f"http://127.0.0.1:{server.server_address[1]}/{mode}/v1"
    kw = {"timeout_s": 0.3, "max_retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05, **kw}
    return J.LLMJudge(url, "judge", api_key="k", **kw)


PROMPT = S.make_prompt(["moon"])


def test_parse_judge_reply_is_strict():
    assert J.parse_judge_reply(GOOD) == (1.0, 0.0)
    assert J.parse_judge_reply(f" ```json\n{GOOD}\n``` ") == (1.0, 0.0)
    assert J.parse_judge_reply('{"style": 1.0, "quality": true}') == (1.0, 1.0)
    for bad in (
        "yes",
        '{"quality": 1}',
        '{"quality": 1, "style": 1, "extra": 0}',
        '{"quality": 0.5, "style": 1}',
        '{"quality": "1", "style": 1}',
        "[1, 1]",
        f"{GOOD} {GOOD}",
        f"sure! {GOOD}",
    ):
        with pytest.raises(J.JudgeError):
            J.parse_judge_reply(bad)
    with pytest.raises(J.JudgeError, match="malformed"):
        J.parse_completion(b'{"choices": []}')


def test_correct_answer_and_request(server):
    judge = _judge(server, "ok")
    assert judge.score(PROMPT, "nya the moon", "cute") == (1.0, 0.0)
    (req,) = server.requests
    user = req["messages"][1]["content"]
    assert "cute" in user and "moon" in user and "nya the moon" in user
    assert _judge(server, "fenced").score(PROMPT, "x", "cute") == (1.0, 0.0)


def test_timeout_is_bounded_and_retried(server):
    judge = _judge(server, "slow", timeout_s=0.2, max_retries=1)
    t0 = time.monotonic()
    with pytest.raises(J.JudgeError, match="after 2 attempts"):
        judge.score(PROMPT, "x", "cute")
    assert time.monotonic() - t0 < 2.0
    assert server.hits["slow"] == 2


def test_total_deadline_cuts_the_retries(server):
    """Each attempt waits 1 s for the slow server; 10 retries would take 10 s+."""
    judge = _judge(server, "slow", timeout_s=0.4, max_retries=10, deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(J.JudgeError, match=r"deadline_s=1\): no complete answer within"):
        judge.score(PROMPT, "x", "cute")
    assert time.monotonic() - t0 < 1.0 + 1.0  # the deadline, plus thread wake-ups
    assert 2 <= server.hits["slow"] <= 3


def test_500s_then_success_is_retried(server):
    judge = _judge(server, "flaky", max_retries=3)
    assert judge.score(PROMPT, "x", "cute") == (1.0, 0.0)
    assert server.hits["flaky"] == 3


def test_garbage_and_client_errors_fail_without_retry(server):
    for mode, match in (("garbage", "not a JSON"), ("badbody", "malformed"), ("missing", "404")):
        with pytest.raises(J.JudgeError, match=match):
            _judge(server, mode).score(PROMPT, "x", "cute")
        assert server.hits[mode] == 1


def test_connection_refused_is_a_judge_error_naming_it():
    judge = J.LLMJudge("http://127.0.0.1:9/v1", "judge", timeout_s=0.2, max_retries=1, backoff_s=0)
    with pytest.raises(J.JudgeError, match="after 2 attempts.*ConnectionRefusedError"):
        judge.score(PROMPT, "x", "cute")


def test_concurrency_cap(server):
    judge = _judge(server, "busy", max_concurrency=2, timeout_s=2.0)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(judge.score(PROMPT, "x", "cute")))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [(1.0, 0.0)] * 6
    assert server.max_in_flight <= 2


def test_style_env_drops_on_judge_failure(server):
    env = S.StyleEnv(judge=_judge(server, "garbage"))
    env.reset(PROMPT)
    r = env.step("nya the moon is fluffy\n")
    assert r.done and r.info["dropped"] is True and "JudgeError" in r.info["error"]
    env = S.StyleEnv(judge=_judge(server, "ok"))
    env.reset(PROMPT)
    r = env.step("nya the moon is fluffy\n")
    assert r.reward == 0.0 and r.info["r_quality"] == 1.0 and "dropped" not in r.info


def test_constructor_checks():
    with pytest.raises(ValueError, match="base_url"):
        J.LLMJudge("ftp://x", "m")
    with pytest.raises(ValueError, match="max_concurrency"):
        J.LLMJudge("http://x", "m", max_concurrency=0)
    with pytest.raises(ValueError, match="deadline_s"):
        J.LLMJudge("http://x", "m", deadline_s=0)
    with pytest.raises(ValueError, match="llm judge config"):
        J.judge_from_config({"base_url": "http://x", "model": "m", "colour": 1})
