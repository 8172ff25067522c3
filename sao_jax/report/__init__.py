"""Reporting: the end-of-run report, experiment tables, paired comparisons, the progress line."""
