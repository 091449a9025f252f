"""Waiting for a set of background tasks to finish, without ever spinning the event loop."""

from __future__ import annotations

import asyncio


async def drain_tasks(tasks: set[asyncio.Task]) -> None:
    """Wait until every task in `tasks` is done, tasks added meanwhile included.

    `tasks` is a set from which each task removes itself with a done callback
    (``task.add_done_callback(tasks.discard)``); that callback runs on a later turn of the loop
    than the one in which the task finished. Waiting on ``asyncio.gather(*tasks)`` while the set
    is not empty would spin there for good: a task that has finished is still in the set, and
    since Python 3.12 a gather of tasks that are all done completes at once, without yielding
    to the loop, so the callback that would take it out never runs (nor does a timeout around
    the wait, nor a signal handler: the proxy stalled with its loop at 100 % of a core). So only
    the tasks not done yet are waited for: each round waits for at least one of them, and yields.
    """
    while pending := [t for t in tasks if not t.done()]:
        await asyncio.gather(*pending, return_exceptions=True)
