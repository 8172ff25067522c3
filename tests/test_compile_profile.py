"""experiments/bench/compile_profile.py: the compile hook in a real interpreter, and the
summary it prints, against a hand count."""

import json
import os
import subprocess
import sys

from experiments.bench import compile_profile as cp


def test_the_hook_records_a_processs_compiles_without_importing_jax_itself(tmp_path):
    code = (
        "import sys; assert 'jax' not in sys.modules, 'the hook imported jax'\n"
        "import jax\n"
        "jax.jit(lambda x: x * 2)(1.0).block_until_ready()\n"
    )
    env = dict(os.environ, COMPILE_PROFILE_OUT=str(tmp_path), PYTHONPATH=str(cp.HOOK))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["xdist_worker"] is False and record["cpu"] > 0
    test = os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]  # inherited: the child's events
    compiles = record["events"][f"{test}|{cp.STAGES['compile']}"]  # are this test's
    assert compiles[1] >= 1 and compiles[0] > 0
    assert record["programs"][f"{test}|jit(<lambda>)"][1] == 1


def test_summary_adds_up_by_kind_program_and_module():
    compile_event, trace_event = cp.STAGES["compile"], cp.STAGES["trace"]
    worker = {
        "xdist_worker": True,
        "cpu": 10.0,
        "events": {f"tests/test_a.py::t|{compile_event}": [3.0, 4], f"-|{trace_event}": [1.0, 2]},
        "programs": {
            "tests/test_a.py::t|jit(step)": [2.9, 1],
            "tests/test_a.py::t|jit(add)": [0.1, 3],
        },
    }
    child = {
        "xdist_worker": False,
        "cpu": 5.0,
        "events": {f"tests/test_b.py::u|{compile_event}": [2.0, 1]},
        "programs": {"tests/test_b.py::u|jit(step)": [2.0, 1]},
    }
    s = cp.summarise([worker, child, dict(worker, cpu=1.0)], small_s=0.1)
    assert s["kinds"]["worker"]["processes"] == 2 and s["kinds"]["worker"]["cpu"] == 11.0
    assert s["kinds"]["worker"]["compile"] == 6.0 and s["kinds"]["worker"]["compile_n"] == 8
    assert s["kinds"]["worker"]["trace"] == 2.0 and s["kinds"]["process"]["compile"] == 2.0
    assert s["programs"][("worker", "jit(step)")] == [5.8, 2]
    assert s["small"] == {"tests/test_a.py": [0.2, 6]}  # jit(add): 0.033 s a compile
    text = cp.report(s, top=5)
    assert "| worker | 2 | 11.0 |" in text and "| process | `jit(step)` | 2.0 | 1 |" in text
