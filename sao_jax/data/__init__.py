"""Prompt sources on grain: the tasks' generators (prompts.py), dataset files (files.py),
and a run's prompts from its config (pipeline.py)."""
