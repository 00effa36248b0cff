"""Which worker pools the library runs under, checked once at worker start.

- ``prefork`` (the default): each pool process starts its own renewer thread after the fork;
- ``threads``: one renewer thread renews the leases of every task thread of the process;
- ``solo``: the renewer thread runs beside the one task;
- ``gevent``, ``eventlet``: refused.

A green pool (Celery marks it ``is_green``: gevent, eventlet, or a custom pool of that kind)
patches ``threading``, so the heartbeat becomes one more greenlet of the hub. A task that runs
CPU-bound code or a C library call that does not yield stops every greenlet, the heartbeat too:
the lease expires while its run goes on, and a duplicate takes the key, which is the one thing
the library exists to prevent. The worker refuses to start rather than guard unreliably.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError

__all__ = ["check_pool", "pool_name"]


def pool_name(pool_cls: Any) -> str:
    """The ``-P`` name of a worker's pool class (``celery.concurrency.gevent:TaskPool`` is
    ``gevent``), or the class's own path for a custom pool."""
    module = str(getattr(pool_cls, "__module__", "") or "")
    if module.startswith("celery.concurrency."):
        short = module.rsplit(".", 1)[-1]
        return "threads" if short == "thread" else short
    return f"{module}:{getattr(pool_cls, '__qualname__', pool_cls)}"


def check_pool(pool_cls: Any) -> None:
    """Raise :class:`ConfigurationError` for a green pool (see the module docstring)."""
    if not getattr(pool_cls, "is_green", False):
        return
    name = pool_name(pool_cls)
    raise ConfigurationError(
        f"the {name} worker pool is not supported: the lease heartbeat is a thread, which {name}'s"
        " monkey-patching turns into a greenlet that any task that does not yield (CPU-bound code,"
        " a blocking C call) stops, so a lease could expire while its run goes on and a duplicate"
        f" would take the key; start the worker with -P prefork (the default), -P threads or -P solo"
    )
