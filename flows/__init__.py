"""Prefect flows, the CLI and the deployments: the only package that imports Prefect.

The library packages log through the standard `logging` module; naming them here (before Prefect
configures logging) sends their lines, model-server and trainer output included, to the run log.
"""

import os

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "data,environments,evaluation,inference,training")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # Machines here reach no telemetry host.
