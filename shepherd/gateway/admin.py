"""The gateway's admin endpoints: list, add and remove backends.

    GET    /admin/backends                     backends with their state
    POST   /admin/backends   {"url": URL}      add a backend
    DELETE /admin/backends   {"url": URL} or ?url=URL

They are off (404) unless the gateway runs with --admin-key, and then they
need `Authorization: Bearer <admin key>` (401 otherwise), checked before the
body is read. Whoever may add a backend may receive other users' prompts and
keys, so the admin key is separate from the client key (--api-key). Link-local
addresses (169.254.0.0/16, fe80::/10: cloud metadata services) are refused as
backends even with the key.
"""
from __future__ import annotations

import ipaddress
import json
from typing import Callable, Optional
from urllib.parse import parse_qs, urlsplit

from shepherd.gateway.backends import BackendPool, normalize_url
from shepherd.gateway.intake import send_json
from shepherd.server.guard import Refusal, error_body, key_error, read_body


def _link_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return ipaddress.ip_address(host).is_link_local
    except ValueError:
        return False


class Admin:
    def __init__(self, pool: BackendPool, admin_key: Optional[str], policy_name: str,
                 max_body_bytes: int = 64 << 10, body_timeout: float = 10.0,
                 kv_status: Optional[Callable[[], dict]] = None) -> None:
        self.pool, self.key, self.policy_name = pool, admin_key, policy_name
        self.kv_status = kv_status       # the KV-event streams' state (kv_routing.py), when configured
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout

    async def handle(self, scope, receive, send) -> None:
        if not self.key:
            return await send_json(send, 404, error_body("admin endpoints are off (start the gateway with "
                                                         "--admin-key to use them)", "not_found_error"))
        method = scope["method"]
        try:
            refused = key_error(scope, self.key, "admin key")
            if refused is not None:
                raise refused
            if method == "GET":
                return await send_json(send, 200, {"policy": self.policy_name,
                                                   "backends": [b.to_dict() for b in self.pool.backends()],
                                                   "kv_events": self.kv_status() if self.kv_status else {}})
            if method not in ("POST", "DELETE"):
                return await send_json(send, 405, error_body(f"{method} not allowed on /admin/backends"))
            body = await read_body(receive, scope, self.max_body_bytes, self.body_timeout, "admin body cap")
            if body is None:
                return
            url = self._url(scope, body)
        except Refusal as r:
            return await send_json(send, r.status, r.payload())
        if method == "POST":
            b = self.pool.add(url, source="admin")
            return await send_json(send, 200, {"added": url, "backend": b.to_dict()})
        if not self.pool.remove(url):
            return await send_json(send, 404, error_body(f"no backend {url}", "not_found_error"))
        return await send_json(send, 200, {"removed": url})

    @staticmethod
    def _url(scope, body: bytes) -> str:
        qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        url = qs["url"][0] if "url" in qs else None
        if url is None and body.strip():
            try:
                obj = json.loads(body)
            except ValueError:
                raise Refusal(400, 'body must be JSON {"url": ...}', "invalid_json") from None
            url = obj.get("url") if isinstance(obj, dict) else None
        if not isinstance(url, str) or not url:
            raise Refusal(400, "a backend 'url' is required", "invalid_request", param="url")
        try:
            url = normalize_url(url)
        except ValueError as e:
            raise Refusal(400, str(e), "invalid_request", param="url") from None
        if _link_local(url):
            raise Refusal(400, f"{url} is a link-local address (a metadata service?); not a backend",
                          "invalid_request", param="url")
        return url
