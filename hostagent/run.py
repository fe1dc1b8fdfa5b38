"""One host agent's process life: run until SIGTERM or SIGINT, then stop cleanly.

SIGTERM and SIGINT stop the agent cleanly: it says goodbye to its broker (without a
state directory the host shows as gone at once; with one, it stays alive for the liveness
TTL, for the next run to take over). :func:`run_agent` returns the process exit status:
0 after a clean stop, :data:`EXIT_START_FAILED` (1) when the agent cannot start (no
broker answers, the host is held by another agent, the fabric is not there). The command
line that builds its :class:`~dxpool.hostagent.config.AgentConfig` is ``dxpool agent``
(:mod:`dxpool.cli.commands.agent`).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from dxpool.errors import DxpoolError
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.drivers import build_driver

log = logging.getLogger("dxpool.hostagent")

EXIT_START_FAILED = 1


def run_agent(config: AgentConfig) -> int:
    """Run one agent until SIGTERM or SIGINT; return the process exit status."""
    try:
        driver = build_driver(config)
    except DxpoolError as error:
        log.error("fabric driver unavailable", extra={"error": error.message})
        return EXIT_START_FAILED
    try:
        agent = Agent(config, driver)
    except DxpoolError as error:  # a token file that cannot be read, a state dir in use
        log.error("agent could not start", extra={"error": error.message})
        return EXIT_START_FAILED

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stop requested", extra={"signal": signal.Signals(signum).name})
        agent.request_stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        agent.start()
        while not agent.wait(0.5):
            pass
        return 0
    except DxpoolError as error:
        log.error("agent could not start", extra={"error": error.message})
        return EXIT_START_FAILED
    finally:
        agent.stop()


__all__ = ["EXIT_START_FAILED", "run_agent"]
