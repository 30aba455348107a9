"""Verification: hidden tests run outside the agent's reach (`hidden_tests`), the agent's functions
called in a child process (`calls`), reward helpers (`rewards`) and rollout scoring (`scoring`)."""
