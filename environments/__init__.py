"""RL environments: the sandbox, the agent loop, verification, and the concrete envs at the top."""

if __name__ == "environments":  # The seeds' spelling, in a checkout: be `flywheel.environments` (seed_alias.py).
    import sys

    from flywheel.environments.seed_alias import install

    sys.modules[__name__] = install()
