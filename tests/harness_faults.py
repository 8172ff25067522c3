"""A harness for the training-run fault tests (tests/test_serve_train.py): it runs
examples/harness/calculator_agent.py unmodified, unless it claims one of the faults
planned in `--plan_dir`.

`<plan_dir>/plan` holds fault names, comma-separated (`crash`, `hang`), handed out in
that order; once
`<plan_dir>/armed` exists, each process tries to claim the next one (`claim-<i>`,
created exclusively: each fault goes to exactly one process). A `crash` makes one chat
call through the real `openai` client, then exits with status 3; a `hang` makes one call,
then sleeps until it is killed. Every other argument goes to the calculator agent.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys
import time

import openai

AGENT = pathlib.Path(__file__).resolve().parents[1] / "examples/harness/calculator_agent.py"


def claim(plan_dir: pathlib.Path) -> str | None:
    if not (plan_dir / "armed").exists():
        return None
    for i, fault in enumerate((plan_dir / "plan").read_text().split(",")):
        try:
            os.close(os.open(plan_dir / f"claim-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        (plan_dir / f"claim-{i}").write_text(f"{fault} {os.getpid()}")
        return fault
    return None


def main() -> None:
    args = sys.argv[1:]
    plan_dir = pathlib.Path(next(a for a in args if a.startswith("--plan_dir=")).split("=", 1)[1])
    args = [a for a in args if not a.startswith("--plan_dir=")]
    fault = claim(plan_dir)
    if fault is None:
        sys.argv = [str(AGENT), *args]
        runpy.run_path(str(AGENT), run_name="__main__")
        return
    print(f"fault: {fault}", flush=True)  # its working directory is kept: the test reads it
    opts = dict(a.removeprefix("--").split("=", 1) for a in args)
    client = openai.OpenAI(base_url=opts["base_url"], api_key=opts["api_key"])
    question = json.loads(opts["task"])["prompt"]
    client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": question}],
        max_tokens=8,
    )
    if fault == "crash":
        os._exit(3)
    while True:  # hang: until killed
        time.sleep(60)


if __name__ == "__main__":
    main()
