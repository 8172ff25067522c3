"""The harness demo that learns (issue 42 item 9): __main__.py runs it, task.py is its task."""
