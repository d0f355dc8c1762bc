"""Bearer-token access: every route, static files and /docs included, when a token is set.

Scripts send `Authorization: Bearer TOKEN`. A browser opens `/?token=TOKEN` once: the page
answers with a redirect to `/` and an HttpOnly cookie that holds a digest of the token (never
the token itself), and the page's requests carry that cookie from then on.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import URL
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "diloco_dashboard"
UNAUTHORIZED = (
    "unauthorized: send 'Authorization: Bearer TOKEN', or open /?token=TOKEN once in a browser\n"
)


class BearerTokenMiddleware:
    """Pure ASGI middleware, so that it guards mounted static files as well as routes."""

    def __init__(self, app: ASGIApp, *, token: str) -> None:
        self.app = app
        self._token = token
        self._cookie = cookie_value(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        connection = HTTPConnection(scope)
        if self._authorized(connection):
            await self.app(scope, receive, send)
            return
        response = self._refusal(connection)
        await response(scope, receive, send)

    def _authorized(self, connection: HTTPConnection) -> bool:
        scheme, _, credentials = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and _same(credentials.strip(), self._token):
            return True
        return _same(connection.cookies.get(COOKIE, ""), self._cookie)

    def _refusal(self, connection: HTTPConnection) -> Response:
        url: URL = connection.url
        if url.path == "/" and _same(connection.query_params.get("token", ""), self._token):
            response: Response = RedirectResponse("/", status_code=303)
            response.set_cookie(COOKIE, self._cookie, httponly=True, samesite="strict")
            return response
        return PlainTextResponse(
            UNAUTHORIZED, status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )


def cookie_value(token: str) -> str:
    return hmac.new(token.encode(), b"diloco-dashboard-cookie", hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
