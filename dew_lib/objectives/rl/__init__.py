"""Preference and reinforcement objectives, and the rollouts that feed them."""
