"""The task and reward registry, the built-in rewards, the dataset task and tool calls."""

import sys
import textwrap

import numpy as np
import pytest

from sao_jax.envs import python_tool, tool_calls
from sao_jax.envs import registry as tasks
from sao_jax.envs.answer import AnswerEnv
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.registry import env_factory, make_env
from sao_jax.envs.rewards import extract_answer, last_boxed

FAST = {"cpu_s": 2, "wall_s": 5.0, "memory_bytes": 256 << 20}


def _p(answer, text="q"):
    return Prompt("u", text, answer=answer)


def test_builtin_tasks_and_rewards_are_registered():
    assert {"arithmetic", "python_tool", "style", "answer"} <= set(tasks.task_names())
    assert {"math", "exact_match", "code_tests"} <= set(tasks.reward_names())
    for name in ("arithmetic", "python_tool", "style"):
        t = tasks.get_task(name)
        assert t.prompts is not None and t.demonstrations is not None
    assert tasks.get_task("answer").prompts is None


def test_unknown_names_are_refused_naming_them():
    with pytest.raises(tasks.RegistryError, match=r"unknown task 'gsm9k'; known: answer, ari"):
        tasks.get_task("gsm9k")
    with pytest.raises(tasks.RegistryError, match=r"unknown reward 'mathh'; known: code_tests"):
        tasks.make_reward("mathh")
    with pytest.raises(tasks.RegistryError, match="cannot import 'no_such_pkg.tasks'"):
        tasks.get_task("no_such_pkg.tasks:Env")
    with pytest.raises(tasks.RegistryError, match="has no 'Nope'"):
        tasks.get_task("sao_jax.envs.answer:Nope")
    with pytest.raises(tasks.RegistryError, match="bad parameters"):
        tasks.make_reward("math", nonsense=1)
    with pytest.raises(ValueError, match="bad parameters"):
        make_env("answer", turns=3)


MODULE = """
from sao_jax.envs.base import StepResult
from sao_jax.envs.registry import Reward, register_reward, register_task


class EchoEnv:
    stop_strings = ()
    max_turns = 1

    def reset(self, prompt):
        return prompt.text

    def step(self, text):
        return StepResult("", float(text == "yes"), True, {"success": text == "yes"})


def sample(rng):
    from sao_jax.envs.base import Prompt
    i = int(rng.integers(100))
    return Prompt(f"echo:{i}", f"say yes {i}", answer="yes")


ECHO = register_task("echo_test_task", env=EchoEnv, prompts=lambda: sample)


@register_reward("shout_test")
def shout(loud=True):
    return lambda text, prompt: Reward(float(text.isupper() == loud), text.isupper() == loud)
"""


def test_a_task_is_one_file_registered_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_tasks_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = tasks.get_task("my_tasks_mod:ECHO")
    assert task.name == "echo_test_task" and tasks.get_task("echo_test_task") is task
    bare = tasks.get_task("my_tasks_mod:EchoEnv")  # an Env class alone is a task too
    assert bare.prompts is None
    factory, hook = env_factory("my_tasks_mod:ECHO", {})
    env = factory()
    env.reset(_p("yes"))
    assert env.step("yes").reward == 1.0 and hook is None
    fn = tasks.make_reward("my_tasks_mod:shout", loud=False)
    assert fn("quiet", _p(None)).score == 1.0
    assert tasks.make_reward("shout_test")("LOUD", _p(None)).success
    from sao_jax.data.prompts import prompt_iterator

    assert next(prompt_iterator("echo_test_task", "train")).answer == "yes"
    sys.modules.pop("my_tasks_mod", None)


def test_boxed_and_pattern_extraction():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert extract_answer("The answer is 7. The answer is 9!", r"answer is (\d+)") == "9"
    assert extract_answer("no answer here") is None


@pytest.mark.parametrize(
    ("gold", "completion", "ok"),
    [
        ("72", r"so \boxed{72}", True),
        ("72", r"\boxed{72.0}", True),
        ("0.5", r"\boxed{\frac{1}{2}}", True),
        (r"\boxed{x+1}", r"\boxed{1+x}", True),
        ("1,000", r"\boxed{1000}", True),
        ("72", r"\boxed{73}", False),
        ("72", "72 without a box", False),
        ("72", r"\boxed{" + "9" * 600 + "}", False),
    ],
)
def test_math_reward_uses_math_verify(gold, completion, ok):
    r = tasks.make_reward("math")(completion, _p(gold))
    assert r.success is ok and r.score == float(ok)


def test_math_reward_with_a_pattern_and_exact_match():
    fn = tasks.make_reward("math", pattern=r"#### (.+)$")
    assert fn("work\n#### 1/2", _p("0.5")).success
    em = tasks.make_reward("exact_match", ignore_case=True)
    assert em(r"\boxed{Paris  France}", _p("paris france")).success
    assert not tasks.make_reward("exact_match")(r"\boxed{Paris}", _p("paris")).success
    with pytest.raises(ValueError, match="prompt 'u' has no reference answer"):
        em(r"\boxed{a}", _p(None))
    with pytest.raises(ValueError, match="not a regex"):
        tasks.make_reward("math", pattern="(")


def test_code_tests_reward_runs_in_the_sandbox():
    fn = tasks.make_reward("code_tests", limits=FAST)
    tests = "assert add(2, 3) == 5"
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    assert fn(good, _p(tests)).success
    r = fn(bad, _p(tests))
    assert not r.success and r.info["error"]
    assert fn("no code", _p(tests)).info["error"] == "no code block"


def test_answer_env_single_turn_raw_text():
    env = AnswerEnv(reward="math")
    assert env.reset(_p("42", "what is 6*7?")) == "what is 6*7?"
    out = env.step(r"it is \boxed{42}")
    assert out.done and out.reward == 1.0 and out.info["success"] and out.info["answer"] == "42"
    with pytest.raises(ValueError, match="no reference answer"):
        env.reset(_p(None))


def test_answer_env_raw_tool_turns():
    env = AnswerEnv(reward="math", tools=("python",), limits=FAST, max_turns=3)
    env.reset(_p("42"))
    out = env.step("```python\nprint(6*7)\n```\n")
    assert not out.done and out.observation == "```output\n42\n```\n"
    assert env.step(r"\boxed{42}").reward == 1.0


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "python", "arguments": {"code": 1}}</tool_call>', "string"),
        ('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "python", "arguments": {}}', "not closed"),
        ('<tool_call>["python"]</tool_call>', "not a JSON object"),
    ],
)
def test_malformed_tool_calls_are_error_observations(turn, error):
    class Chat:  # the observation text is what matters here, not a template
        def messages(self, text, messages=None):
            return [{"role": "user", "content": text}]

        def prompt(self, messages, tools=None):
            return messages[0]["content"]

        def observation(self, messages, tools=None):
            return "<obs>" + messages[0]["content"]

    env = AnswerEnv(reward="math", tools=("python",), chat=Chat(), max_turns=2)
    env.reset(_p("1"))
    out = env.step(turn)
    assert isinstance(out, StepResult) and not out.done
    assert error in out.info["error"] and out.observation.startswith("<obs>error: ")
    out = env.step(turn)  # the last turn: truncated, no crash
    assert out.done and out.reward == 0.0 and out.info["truncated"]


def test_tool_call_parser():
    text = 'x <tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}\n</tool_call>'
    calls, error = tool_calls.parse_tool_calls(text)
    assert error is None and calls == [tool_calls.ToolCall("python", {"code": "1"})]
    assert tool_calls.parse_tool_calls("plain text") == ([], None)
    many = '<tool_call>{"name": "a"}</tool_call>' * (tool_calls.MAX_CALLS + 1)
    assert "tool calls in one turn" in tool_calls.parse_tool_calls(many)[1]
    assert tool_calls.content_of("hi <tool_call>{}</tool_call>") == "hi"


def test_python_tool_env_accepts_qwen3_tool_calls():
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(2+2)"}}</tool_call>'
    assert python_tool.extract_code(call) == ("print(2+2)", None)
    code, error = python_tool.extract_code("<tool_call>{bad</tool_call>")
    assert code is None and "JSON" in error
    env = python_tool.PythonToolEnv(limits=python_tool.sandbox.SandboxLimits(**FAST))
    env.reset(Prompt("a", "q:2+2\n", answer=4))
    out = env.step("<tool_call>{bad</tool_call>")
    assert not out.done and out.observation.endswith("e:bad\n")


def test_demonstrations_come_from_the_registry():
    from sao_jax.run import sft

    rng = np.random.default_rng(0)
    prompt = next(iter(_arith_prompts()))
    segments = sft.demonstration("arithmetic", prompt, rng, 0.0)
    assert segments[0] == (prompt.text, False) and segments[-1][1]
    with pytest.raises(ValueError, match="no demonstrations for task 'answer'"):
        sft.demonstration("answer", prompt, rng, 0.0)


def _arith_prompts():
    from sao_jax.data.prompts import prompt_source

    return prompt_source("arithmetic", "eval", size=2)


def test_docstring_example_of_tasks_module():
    doc = textwrap.dedent(tasks.__doc__)
    assert "register_task" in doc and "env.name=my_pkg.tasks:MY_TASK" in doc
