"""Shared code for train.py, eval.py and profile.py (one concern a module)."""
