"""The engine: the device programs over a pool of KV pages (engine.py), the host loop that
admits requests into rows and keeps them busy (scheduler.py, its pages pages.py), and what the
two and their callers share (types.py)."""

from runner.engine.engine import Engine, Layout, Runner
from runner.engine.scheduler import Scheduler, generate
from runner.engine.types import Completion, Request, Stats

__all__ = ["Completion", "Engine", "Layout", "Request", "Runner", "Scheduler", "Stats", "generate"]
