"""A calculator agent written the way users write one: a plain `openai` client loop.

Nothing here knows about SAO: the loop sends the conversation with one tool, runs every
tool call the model makes, appends the results as `tool` messages and stops at the first
reply without tool calls. Pointed at a gateway session (docs/harness.md), every call is
recorded; the reward is posted at the end.

Against a running gateway (it opens its own session):

  python -m experiments.serve --config=configs/harness.py:smoke --workdir=/tmp/gw &
  python examples/harness/calculator_agent.py --gateway=/tmp/gw/gateway.json \
      --question="what is 12 + 30?" --answer=42

Run by the training driver (configs/harness.py's `gateway.harness.command`: one process
per task, given its session's base URL and key and the task as JSON):

  python examples/harness/calculator_agent.py --base_url=URL --api_key=KEY \
      --task='{"prompt": "what is 12 + 30?", "answer": 42}'
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import urllib.request

import openai

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "Use the calculator tool, then answer with the number."
MAX_TURNS = 4  # calls per episode; the last reply without tool calls is the answer
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}  # fmt: skip


def calculator(expression: str) -> str:
    """The value of + - * / and parentheses over numbers, or an error message."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ( )")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else round(result, 6))


def messages_for(question: str) -> list[dict]:
    """The conversation an episode opens with."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def run_episode(client: openai.OpenAI, model: str, question: str, max_turns: int = MAX_TURNS):
    """(final answer text, messages) of one episode."""
    messages = messages_for(question)
    for _ in range(max_turns):
        reply = (
            client.chat.completions.create(
                model=model, messages=messages, tools=[TOOL], max_tokens=64
            )
            .choices[0]
            .message
        )
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or "", messages
        for call in reply.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = calculator(str(args.get("expression", "")))
            except (json.JSONDecodeError, AttributeError):
                result = "error: arguments are not a JSON object"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "", messages


def reward(answer_text: str, answer: str) -> float:
    """1 when the last number in the answer is the expected one."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer_text)
    return float(bool(numbers) and numbers[-1] == answer)


def _post(url: str, key: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", help="the gateway's gateway.json (opens a session)")
    parser.add_argument("--question")
    parser.add_argument("--answer")
    parser.add_argument("--base_url", help="a session's base URL (with --api_key, --task)")
    parser.add_argument("--api_key")
    parser.add_argument("--task", help='the task as JSON: {"prompt": ..., "answer": ...}')
    args = parser.parse_args()
    if args.base_url:  # run by the training driver: the session exists
        task = json.loads(args.task)
        question, answer = task["prompt"], str(task["answer"])
        client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
        model = client.models.list().data[0].id
        reward_url, key = args.base_url + "/reward", args.api_key
    else:
        with open(args.gateway) as f:
            g = json.load(f)
        question, answer, model = args.question, args.answer, g["model"]
        session = _post(g["base_url"] + "/sessions", g["api_key"], {"task": question})
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
        reward_url = f"{g['base_url']}/sessions/{session['id']}/reward"
        key = session["api_key"]
    text, _ = run_episode(client, model, question)
    r = reward(text, answer)
    _post(reward_url, key, {"reward": r})
    print(json.dumps({"answer": text, "reward": r}))


if __name__ == "__main__":
    main()
