"""What the ingress hands a replica, and where the ingress finds its process's router.

Kept apart from ray_router.py because Ray pickles a request router's module
by value into each process: state and types shared with the ingress must
live in a module imported the normal way (one `HttpCall` class, one registry).
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from shepherd.routing import RouteRequest


@dataclass
class HttpCall:
    """One HTTP request as the ingress hands it to a replica: the handle call's only argument."""
    method: str
    path: str
    query_string: bytes = b""
    headers: list = field(default_factory=list)      # [(name, value)], bytes, as in an ASGI scope
    body: bytes = b""
    route: Optional[RouteRequest] = None             # what the policy reads; None: any replica will do
    exclude: frozenset = frozenset()                 # replica ids that already answered 429/503 to it
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    decided: Optional[str] = None                    # the policy's choice, kept across Ray's re-routes
    routed_to: Optional[str] = None                  # set once a replica accepted it, until `finished`
    ended: bool = False                              # the ingress is done with it

    @property
    def prompt(self) -> str:
        """What Ray's own PrefixCacheAffinityRouter matches on (it reads `.prompt` of the
        first argument, and divides by its length): the same text shepherd's policies see."""
        return self.route.text if self.route is not None and self.route.text else "-"


_LIVE: dict = {}          # deployment name -> the ShepherdRouter of this process's handle
_LIVE_LOCK = threading.Lock()


def register_router(deployment: str, router: Any) -> None:
    with _LIVE_LOCK:
        _LIVE[deployment] = router


def live_router(deployment: str) -> Optional[Any]:
    """The shepherd router (ray_router.ShepherdRouter) this process uses for `deployment`,
    once its handle made one."""
    with _LIVE_LOCK:
        return _LIVE.get(deployment)


def call_of(pending: Any) -> Optional[HttpCall]:
    """The HttpCall of a Ray PendingRequest (its first argument), if it is one."""
    if pending is None or not pending.args:
        return None
    arg = pending.args[0]
    return arg if isinstance(arg, HttpCall) else None
