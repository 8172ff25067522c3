"""The serve entry's library side (sao_jax/serve/launch.py): configs/harness.py:smoke
served in-process from a fresh workdir (the local tokenizer built, no SFT), gateway.json
written whole once it accepts connections, a call answered, and on stop the live
sessions' episodes written as dropped."""

import json
import threading
import time

import openai

from sao_jax import config as config_lib
from sao_jax.serve.gateway import GatewayConfig
from sao_jax.serve.launch import serve
from sao_jax.text.harness_tokenizer import CALCULATOR_TOOL
from tests.serve_support import episodes, http


def test_serve_harness_smoke(tmp_path):
    config = config_lib.load_config("configs/harness.py:smoke")
    with config.unlocked():
        config.sampling.update(num_slots=2, max_len=512)
    stop = threading.Event()
    errors = []

    def run():
        try:
            serve(config, tmp_path, GatewayConfig(), stop=stop)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    path = tmp_path / "gateway.json"
    deadline = time.monotonic() + 120
    while not path.exists() and not errors and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not errors and path.exists()
    info = json.loads(path.read_text())
    assert set(info) == {"base_url", "api_key", "port", "model", "pid"}
    assert info["base_url"] == f"http://127.0.0.1:{info['port']}/v1"
    assert (tmp_path / "tokenizer" / "chat_template.jinja").exists()
    _, _, s = http("POST", f"{info['base_url']}/sessions", {"task": 1}, info["api_key"])
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    r = client.chat.completions.create(
        model=info["model"], messages=[{"role": "user", "content": "what is 3 + 4?"}],
        tools=[CALCULATOR_TOOL], max_tokens=3,
    )  # fmt: skip
    assert r.usage.completion_tokens >= 1
    stop.set()
    thread.join(60)
    assert not thread.is_alive() and not errors
    (ep,) = episodes(tmp_path)
    assert ep["dropped"] == "shutdown" and ep["calls"] == 1 and ep["reward"] is None
