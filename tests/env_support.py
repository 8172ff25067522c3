"""Helpers of the env tests: play a list of model turns through an env."""


def play(env, prompt, turns):
    """The StepResults of `turns` from a fresh episode of `prompt`, up to the one that ends it."""
    env.reset(prompt)
    results = []
    for turn in turns:
        results.append(env.step(turn))
        if results[-1].done:
            break
    return results
