"""The express lane: requests for a fixed path served without the framework's router.

FastAPI finds a request's route by trying every route of every included router in turn, then
solves the endpoint's dependencies; for a one-input embedding that was over a third of the event
loop's work per request, and most of /health's (docs/performance/latency.md). Most of our routes
need neither: their path has no parameters and their endpoint takes the request alone and returns
a ``Response``. ``ExpressLane`` serves those routes with one dict look-up and a direct call, and
hands every other request to the app unchanged.

What stays the same, by construction:
- which endpoint answers: ``express_routes`` keeps a (method, path) only where the first route
  that matches it, in the app's order, is the eligible one (a parameterised route earlier in the
  list that would take the path keeps it in the router);
- errors: the endpoint runs inside Starlette's own ``ExceptionMiddleware``, built from the
  handlers the app registered (``install_handlers``) as Starlette builds it, so each failure has
  the same body and status; an exception with no handler propagates to the server-error
  middleware as before;
- the scope: ``route``, ``endpoint`` and ``path_params`` are set as the router sets them.
The lane sits innermost among the app's own middleware (inside FrontDoor, which has already
checked the key, the media type and read the body), so every request still passes those.
"""
from __future__ import annotations

import inspect
import typing
from typing import Any, Iterable, Iterator, Mapping

from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute


def route_path(scope: Mapping[str, Any]) -> str:
    """The path the router matches: ``path`` less ``root_path`` (as Starlette's routing reads it)."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


def flat_routes(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """``routes`` in matching order, an included router's routes in its place (FastAPI keeps an
    included router as one entry; ours are included without a prefix or dependencies)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from flat_routes(inner.routes)
        else:
            yield route


def eligible(route: BaseRoute) -> bool:
    """A route the lane may serve: a fixed path, and an async endpoint whose only parameter (if
    any) is the request and which is declared to return a ``Response`` (so nothing of FastAPI's
    serialisation or dependency solving applies to it)."""
    endpoint = getattr(route, "endpoint", None)
    dependant = getattr(route, "dependant", None)
    path = getattr(route, "path", "")
    if endpoint is None or dependant is None or "{" in path or not inspect.iscoroutinefunction(endpoint):
        return False
    if (dependant.path_params or dependant.query_params or dependant.header_params or dependant.cookie_params
            or dependant.body_params or dependant.dependencies):
        return False
    params = list(inspect.signature(endpoint).parameters)
    if len(params) > 1 or (params and params[0] != dependant.request_param_name):
        return False
    try:
        returns = typing.get_type_hints(endpoint).get("return")
    except (NameError, TypeError):
        return False
    return isinstance(returns, type) and issubclass(returns, Response)


def express_routes(routes: Iterable[BaseRoute]) -> dict[tuple[str, str], BaseRoute]:
    """(method, path) -> route, for the eligible routes that the router would choose first."""
    ordered = list(flat_routes(routes))
    table: dict[tuple[str, str], BaseRoute] = {}
    for route in ordered:
        if not eligible(route):
            continue
        path = getattr(route, "path")
        for method in getattr(route, "methods", None) or ():
            first = next(r for r in ordered if _takes(r, method, path))
            if first is route:
                table[(method, path)] = route
    return table


def _takes(route: BaseRoute, method: str, path: str) -> bool:
    regex = getattr(route, "path_regex", None)
    methods = getattr(route, "methods", None)
    if regex is None or not regex.match(path):
        return False
    return methods is None or method in methods  # a Mount (no methods) takes every method


class ExpressLane:
    """ASGI middleware: a request whose (method, path) is in the table goes straight to its
    endpoint, under the app's exception handlers; any other request goes on to ``app``.

    ``routes``: the app's live route list (``app.router.routes``); the table is built from it at
    the first request, as Starlette builds its middleware stack, and again whenever the list's
    entries change (a route inserted after the app was made, as a front end's /metrics is).
    ``exception_handlers``: the app's live mapping, read at the same moments.
    """

    def __init__(self, app, *, routes: list[BaseRoute], exception_handlers: Mapping[Any, Any]) -> None:
        self.app = app
        self.source = routes
        self.exception_handlers = exception_handlers
        self.seen: tuple[int, ...] | None = None
        self.routes: dict[tuple[str, str], BaseRoute] = {}
        self.guarded: ExceptionMiddleware | None = None  # _serve under the handlers (_refresh)

    def _refresh(self) -> ExceptionMiddleware:
        """The guarded endpoint caller, the table and the handlers rebuilt if the routes changed."""
        seen = tuple(map(id, self.source))
        if seen != self.seen or self.guarded is None:
            self.routes = express_routes(self.source)
            # as Starlette splits them: Exception/500 belong to the server-error middleware outside
            handlers = {k: v for k, v in self.exception_handlers.items() if k not in (500, Exception)}
            self.guarded = ExceptionMiddleware(self._serve, handlers=handlers)
            self.seen = seen
        return self.guarded

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            guarded = self._refresh()
            route = self.routes.get((scope["method"], route_path(scope)))
            # NOTE: with FastAPI's own telemetry on, the router records the route it selects: leave it to it
            if route is not None and scope.get("fastapi.telemetry") is None:
                scope["route"] = route  # as the router sets it; _serve reads it back
                await guarded(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, scope, receive, send) -> None:
        route = scope["route"]
        endpoint = route.endpoint
        scope["endpoint"] = endpoint
        scope["path_params"] = {}
        if route.dependant.request_param_name:
            response = await endpoint(Request(scope, receive, send))
        else:
            response = await endpoint()
        await response(scope, receive, send)
