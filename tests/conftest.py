"""Shared pytest fixtures: tiny random checkpoints, built once per session."""
