"""The engine: the device programs that prefill requests into rows of KV cache and decode them
(engine.py), the host loop that keeps those rows busy (scheduler.py), and the move of its CPU
arrays onto huge pages (hugepages.py)."""

from runner.engine.engine import Completion, Engine, Request
from runner.engine.scheduler import Scheduler, Stats, generate

__all__ = ["Completion", "Engine", "Request", "Scheduler", "Stats", "generate"]
