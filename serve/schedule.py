"""A command the engine deployment runs on a schedule (``serving.adapt_schedule``): the adaptation loop.

    adapt_schedule:
      command: [python, -m, eagleray.jobs.adapt, --config, jobs/configs/adapt-smollm2-cpu.yaml, --once]
      every_s: 3600

One run at a time, in the replica's working directory, its output appended to ``log``; each exit is
logged and counted (``eagleray_adapt_runs_total{outcome}``). The Serve app picks up a promoted draft
through its alias poller, as with an adaptation job submitted any other way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from eagleray.serve.prometheus import ServeMetrics

logger = logging.getLogger(__name__)


async def run_every(command: list[str], every_s: float, log: Path, metrics: ServeMetrics, drop_env: Iterable[str] = ()) -> None:
    """Forever: wait ``every_s``, run ``command`` to its end (output to ``log``), count the outcome. The command runs
    in this process's environment less ``drop_env`` (the replica's own settings, e.g. its passive OpenMP workers,
    which would slow a training run's many small parallel regions)."""
    drop = set(drop_env)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    log.parent.mkdir(parents=True, exist_ok=True)
    while True:
        await asyncio.sleep(every_s)
        with open(log, "ab") as out:
            try:
                proc = await asyncio.create_subprocess_exec(*command, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env)
            except OSError as err:  # the command cannot start (not found, not executable): logged, counted, retried
                logger.error("adapt schedule: cannot start %s: %s", command, err)
                metrics.record_adapt_run("not_started")
                continue
            code = await proc.wait()
        logger.info("adapt schedule: %s exited with %d (output in %s)", command[:4], code, log)
        metrics.record_adapt_run("ok" if code == 0 else "failed")
