"""The device check: accelerator paths against their CPU-verified references, and what the
device does with them (experiments/device_check.py; runner.py lists the phases)."""
