"""Prefect flows, the CLI and the deployments: the only package that imports Prefect.

The library packages log through the standard `logging` module. Naming them in
PREFECT_LOGGING_EXTRA_LOGGERS (here, before Prefect configures logging, and in prefect.yaml for
deployment runs) gives them Prefect's run-log handler; Prefect leaves their level to the root's
WARNING, so they are set to INFO here: model-server and trainer lines then reach the run log.
"""

import logging
import os

LIBRARY_LOGGERS = tuple(f"flywheel.{name}" for name in ("data", "environments", "evaluation", "inference", "training"))

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", ",".join(LIBRARY_LOGGERS))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # Machines here reach no telemetry host.
# The temporary server `flywheel round` starts migrates a fresh SQLite first: on 2 busy cores that took
# over Prefect's 20 s and the round failed before it began.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
for _name in LIBRARY_LOGGERS:
    logging.getLogger(_name).setLevel(logging.INFO)
