"""Plumbing every layer may use: bounded JSON, the staged-directory rule, user directories,
a background thread. Nothing here knows what an artifact is."""
