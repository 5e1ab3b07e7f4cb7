"""One Kubernetes API endpoint for tests: the real CRD server plus an emulated core API.

apiextensions-apiserver serves CRDs and custom resources for real but has no ``/api``, no
``/api/v1`` and not even an ``/apis`` group list, so kopf, kubectl and the kubernetes client
cannot use it alone. ``ClusterProxy`` listens on plain HTTP on 127.0.0.1 and

- answers ``/api`` and ``/api/v1`` (discovery and every core request) from a ``CoreStore``;
- builds ``/apis`` from the CRDs the real server has established;
- forwards everything else (``/apis/<group>/...``, ``/openapi``, ``/version``, ``/livez``) to
  the real server with the admin client certificate, streaming, so that watches of custom
  resources work through it;
- deletes core objects whose owners (``ownerReferences``) are all gone, like the garbage
  collector a real cluster runs (custom-resource owners are looked up on the real server).

It runs an aiohttp server on its own event loop in a background thread; ``start()`` and
``stop()`` are bounded, and ``stop()`` ends open watch streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from yarl import URL

from tests.k8s.apiserver import ApiServer, ApiServerError
from tests.k8s.core import KINDS, ApiError, CoreStore, Obj, table

__all__ = ["ClusterProxy"]

log = logging.getLogger(__name__)

_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer"}
_DROP_REQUEST = _HOP | {"host", "authorization", "content-length"}
_DROP_RESPONSE = _HOP | {"content-length"}
_PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/json-patch+json": "json",
    "application/apply-patch+yaml": "apply",
}
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
    )


def _version_key(version: str) -> tuple[int, int, int, str]:
    """Kubernetes version priority: GA before beta before alpha, higher numbers first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if m is None:
        return (3, 0, 0, version)
    stage = {None: 0, "beta": 1, "alpha": 2}[m[2]]
    return (stage, -int(m[1]), -int(m[3] or 0), version)


def _core_resources() -> Obj:
    resources: list[Obj] = []
    for kind in KINDS.values():
        entry: Obj = {
            "name": kind.plural,
            "singularName": kind.kind.lower(),
            "namespaced": kind.namespaced,
            "kind": kind.kind,
            "verbs": _VERBS,
        }
        if kind.short_names:
            entry["shortNames"] = list(kind.short_names)
        if kind.categories:
            entry["categories"] = list(kind.categories)
        resources.append(entry)
        if kind.status:
            resources.append(
                {
                    "name": f"{kind.plural}/status",
                    "singularName": "",
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "v1",
        "resources": resources,
    }


class ClusterProxy:
    """The front proxy; ``url`` and ``kubeconfig`` are what clients use, ``core`` the store.

    Use as a context manager (or ``start()`` / ``stop()``).
    """

    def __init__(
        self,
        apiserver: ApiServer,
        workdir: Path,
        core: CoreStore | None = None,
        gc_interval: float | None = 0.5,
    ) -> None:
        self.apiserver = apiserver
        self.workdir = Path(workdir)
        self.core = core if core is not None else CoreStore()
        self.kubeconfig = self.workdir / "kubeconfig"
        self.url = ""
        self.gc_interval = gc_interval
        self._upstream = apiserver.url
        self._ssl = apiserver.ssl_context()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watch_queues: set[asyncio.Queue[tuple[str, Obj] | None]] = set()
        self._upstreams: set[aiohttp.ClientResponse] = set()
        self._plurals: dict[tuple[str, str], tuple[str, bool]] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> ClusterProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        """Serve on a free port of 127.0.0.1 and write the kubeconfig; raise if not up in time."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="k8s-cluster-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise ApiServerError(f"cluster proxy: not serving after {timeout:.0f} s")
        if self._error is not None:
            self.stop()
            raise ApiServerError(f"cluster proxy failed to start: {self._error!r}") from self._error
        self._write_kubeconfig()

    def stop(self, timeout: float = 10.0) -> None:
        """Close every open request (watches included), the server and the loop's thread."""
        loop, stopping, thread = self._loop, self._stopping, self._thread
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(stopping.set)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise ApiServerError(f"cluster proxy: thread still running after {timeout:.0f} s")
        self._thread = self._loop = self._stopping = None

    def env(self) -> dict[str, str]:
        """Environment for a child process (kopf, kubectl) that should talk to this cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by start(); the thread must not die silently
            self._error = e
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl, limit=0),
            auto_decompress=False,  # bodies pass through as the server encoded them
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0,
            handler_cancellation=True,  # a client that hangs up ends its watch
        )  # fmt: skip
        gc_task: asyncio.Task[None] | None = None
        try:
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            if self.gc_interval:
                gc_task = asyncio.create_task(self._collect_garbage(self.gc_interval))
            self._ready.set()
            await self._stopping.wait()
        finally:
            # End streams cleanly (a last chunk, not a reset): core watches get a sentinel, and
            # closing their upstream responses ends the forwarded ones; the rest are cancelled.
            if gc_task is not None:
                gc_task.cancel()
            for events in self._watch_queues:
                events.put_nowait(None)
            for upstream in self._upstreams:
                upstream.close()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=2.0)
            for task in self._tasks:
                task.cancel()
            await runner.cleanup()
            await self._session.close()

    def _write_kubeconfig(self) -> None:
        # No credentials: the proxy holds the admin certificate for the real server itself.
        names = {"cluster": "malleus-test", "user": "malleus-test-user"}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": names["cluster"], "cluster": {"server": self.url}}],
            "users": [{"name": names["user"], "user": {}}],
            "contexts": [
                {"name": "malleus-test", "context": {**names, "namespace": "default"}},
            ],
            "current-context": "malleus-test",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))

    # -- routing ------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            path = request.path.rstrip("/")
            if path == "/api":
                host = request.host or self.url.removeprefix("http://")
                cidr = {"clientCIDR": "0.0.0.0/0", "serverAddress": host}
                return _json(
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [cidr],
                    }
                )
            if path == "/api/v1":
                return _json(_core_resources())
            if path.startswith("/api/v1/"):
                return await self._core(request, path.removeprefix("/api/v1/").split("/"))
            if path == "/apis":
                return _json(await self._groups())
            return await self._forward(request)
        except ApiError as e:
            return _json(e.status(), e.code)
        except Exception as e:  # a bug here must reach the client, not just a log
            log.exception("cluster proxy: %s %s failed", request.method, request.path)
            return _json(ApiError(500, "InternalError", f"proxy: {e!r}").status(), 500)
        finally:
            self._tasks.discard(task)

    async def _groups(self) -> Obj:
        """``/apis`` from the established CRDs (the real server does not serve this list)."""
        crds = await self._upstream_json("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        if crds is None:
            raise ApiError(503, "ServiceUnavailable", "the CRD server did not list its CRDs")
        versions: dict[str, set[str]] = {"apiextensions.k8s.io": {"v1"}}
        for crd in crds.get("items") or []:
            conditions = (crd.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                served = {v["name"] for v in crd["spec"]["versions"] if v.get("served")}
                versions.setdefault(crd["spec"]["group"], set()).update(served)
        groups = []
        for group, names in sorted(versions.items()):
            entries = [
                {"groupVersion": f"{group}/{v}", "version": v}
                for v in sorted(names, key=_version_key)
            ]
            if entries:
                groups.append({"name": group, "versions": entries, "preferredVersion": entries[0]})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    # -- the core API -------------------------------------------------------------------------

    async def _core(self, request: web.Request, parts: list[str]) -> web.StreamResponse:
        query = request.query
        watch = query.get("watch") in ("true", "1")
        if parts[0] == "watch":  # the legacy /api/v1/watch/... form
            parts, watch = parts[1:], True
        if len(parts) >= 3 and parts[0] == "namespaces" and parts[2] in KINDS:
            namespace, plural, rest = parts[1], parts[2], parts[3:]
        else:
            namespace, plural, rest = None, parts[0], parts[1:]
        kind = KINDS.get(plural)
        name = rest[0] if rest else None
        sub = rest[1] if len(rest) > 1 else None
        if (
            kind is None
            or len(rest) > 2
            or (sub is not None and (sub != "status" or not kind.status))
            or (namespace is not None and not kind.namespaced)
            or (name is not None and kind.namespaced and namespace is None)
        ):
            raise ApiError(404, "NotFound", f"the server could not find {request.path}")
        store, ns, method = self.core, namespace or "", request.method
        label, field = query.get("labelSelector"), query.get("fieldSelector")
        wants_table = "as=Table" in request.headers.get("Accept", "")

        if name is None:
            if method == "GET" and watch:
                return await self._watch(request, plural, namespace, wants_table)
            if method == "GET":
                body = store.list_body(plural, namespace, label, field)
                if wants_table:
                    return _json(table(plural, body["items"], body["metadata"]["resourceVersion"]))
                return _json(body)
            if method == "POST":
                return _json(store.create(plural, ns, await _body(request)), 201)
            if method == "DELETE":
                deleted = store.delete_collection(plural, namespace, label, field)
                version = {"resourceVersion": store.resource_version}
                return _json(
                    {"kind": f"{kind.kind}List", "apiVersion": "v1", "metadata": version,
                     "items": deleted}
                )  # fmt: skip
        elif method == "GET":
            obj = store.get(plural, ns, name)
            if wants_table:
                return _json(table(plural, [obj], obj["metadata"]["resourceVersion"]))
            return _json(obj)
        elif method == "PUT":
            return _json(store.replace(plural, ns, name, await _body(request), sub == "status"))
        elif method == "PATCH":
            return _json(await self._patch(request, plural, ns, name, sub == "status"))
        elif method == "DELETE":
            obj = store.delete(plural, ns, name)
            if kind.delete_returns_object or obj["metadata"].get("deletionTimestamp"):
                return _json(obj)  # pods and the like, or an object finalizers still hold
            details = {"name": name, "kind": plural, "uid": obj["metadata"]["uid"]}
            return _json(
                {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                 "details": details}
            )  # fmt: skip
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {request.path}")

    async def _patch(
        self, request: web.Request, plural: str, ns: str, name: str, status: bool
    ) -> Obj:
        patch_type = _PATCH_TYPES.get(request.content_type)
        if patch_type is None:
            raise ApiError(415, "UnsupportedMediaType", f"patch type {request.content_type!r}")
        text = await request.text()
        try:
            patch = yaml.safe_load(text) if patch_type == "apply" else json.loads(text)
        except (ValueError, yaml.YAMLError) as e:
            raise ApiError(400, "BadRequest", f"cannot decode the patch: {e}") from None
        if patch_type == "apply":  # server-side apply, approximated: merge, or create
            try:
                return self.core.patch(plural, ns, name, patch, "merge", status)
            except ApiError as e:
                if e.code != 404 or status:
                    raise
                return self.core.create(
                    plural, ns, {**patch, "metadata": {**patch.get("metadata", {}), "name": name}}
                )
        return self.core.patch(plural, ns, name, patch, patch_type, status)

    async def _watch(
        self, request: web.Request, plural: str, namespace: str | None, as_table: bool
    ) -> web.StreamResponse:
        """A watch stream: JSON lines of {type, object} until timeoutSeconds or a hang-up.

        ``as_table`` (``kubectl get -w``) sends every object as a one-row Table, as servers do.
        """
        query = request.query

        def line(event_type: str, obj: Obj) -> bytes:
            if as_table and event_type != "BOOKMARK":
                obj = table(plural, [obj], obj["metadata"]["resourceVersion"])
            return _line({"type": event_type, "object": obj})

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Obj] | None] = asyncio.Queue()  # None: stop

        def push(event_type: str, obj: Obj) -> None:  # runs on the writer's thread
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(events.put_nowait, (event_type, obj))

        initial = query.get("sendInitialEvents") == "true"
        since = None if initial else query.get("resourceVersion")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        try:
            first, unsubscribe = self.core.subscribe(
                plural,
                namespace,
                since,
                push,
                query.get("labelSelector"),
                query.get("fieldSelector"),
            )
        except ApiError as e:
            if e.code != 410:
                raise
            await response.prepare(request)  # a too old version is an ERROR event, as for real
            await response.write(_line({"type": "ERROR", "object": e.status()}))
            return response
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        deadline = None if timeout is None else loop.time() + timeout
        self._watch_queues.add(events)
        if self._stopped():  # stop() has ended the streams it saw: end this one too
            events.put_nowait(None)
        try:
            await response.prepare(request)
            for event_type, obj in first:
                await response.write(line(event_type, obj))
            if initial:
                bookmark = {
                    "kind": KINDS[plural].kind,
                    "apiVersion": "v1",
                    "metadata": {
                        "resourceVersion": self.core.resource_version,
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                }
                await response.write(line("BOOKMARK", bookmark))
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(events.get(), remaining)
                except TimeoutError:
                    break
                if event is None:
                    break
                await response.write(line(*event))
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            unsubscribe()
            self._watch_queues.discard(events)
        return response

    # -- the real server ----------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        """Pass a request to the real server and stream its answer back (watches included)."""
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        body = await request.read()
        url = URL(self._upstream + request.raw_path, encoded=True)
        try:
            upstream_cm = self._session.request(
                request.method,
                url,
                headers=headers,
                data=body or None,
                # aiohttp would add Content-Type: application/octet-stream (-> 415) and its own
                # Accept-Encoding (then the body would arrive compressed unasked).
                skip_auto_headers=["Content-Type", "Accept-Encoding"],
                allow_redirects=False,
            )
            async with upstream_cm as upstream:
                # stop() closes it to end a watch cleanly: registered before the first await
                # below, and closed here if stop() came first (it closes only those it sees)
                self._upstreams.add(upstream)
                if self._stopped():
                    upstream.close()
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for key, value in upstream.headers.items():
                    if key.lower() not in _DROP_RESPONSE:
                        response.headers.add(key, value)
                try:
                    await response.prepare(request)
                    with contextlib.suppress(aiohttp.ClientError):  # either side hung up
                        async for chunk in upstream.content.iter_any():
                            await response.write(chunk)
                    with contextlib.suppress(ConnectionError):
                        await response.write_eof()
                finally:
                    self._upstreams.discard(upstream)
                return response
        except aiohttp.ClientConnectionError as e:
            raise ApiError(
                503, "ServiceUnavailable", f"the CRD server is unreachable: {e}"
            ) from None

    def _stopped(self) -> bool:
        """stop() has begun: a stream that opens now must end at once (see `_main`)."""
        return self._stopping is None or self._stopping.is_set()

    async def _upstream_json(self, path: str) -> Obj | None:
        """GET a path on the real server: the decoded body, or None on 404 / failure."""
        assert self._session is not None
        try:
            async with self._session.get(
                self._upstream + path, headers={"Accept-Encoding": "identity"}
            ) as response:
                if response.status != 200:
                    return None
                decoded: Obj = json.loads(await response.read())
                return decoded
        except (aiohttp.ClientError, ValueError):
            return None

    # -- garbage collection -------------------------------------------------------------------

    async def _collect_garbage(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.collect_garbage_once()
            except Exception:  # never let one bad pass stop collection
                log.exception("cluster proxy: garbage collection failed")

    async def collect_garbage_once(self) -> list[Obj]:
        """Delete core objects all of whose owners are gone (unknown owners count as alive)."""
        deleted: list[Obj] = []
        alive: dict[tuple[str, str, str, str, str], bool] = {}
        for plural in KINDS:
            for obj in self.core.list(plural):
                refs = obj["metadata"].get("ownerReferences") or []
                ns = obj["metadata"].get("namespace", "")
                states = []
                for ref in refs:
                    key = (ref["apiVersion"], ref["kind"], ns, ref["name"], ref.get("uid", ""))
                    if key not in alive:
                        alive[key] = await self._owner_alive(*key)
                    states.append(alive[key])
                if refs and not any(states):
                    with contextlib.suppress(ApiError):
                        deleted.append(self.core.delete(plural, ns, obj["metadata"]["name"]))
        return deleted

    async def _owner_alive(self, api_version: str, kind: str, ns: str, name: str, uid: str) -> bool:
        if api_version == "v1":
            plural = next((k.plural for k in KINDS.values() if k.kind == kind), None)
            if plural is None:
                return True
            try:
                found = self.core.get(plural, ns, name)
            except ApiError:
                return False
        else:
            resource = await self._resource(api_version, kind)
            if resource is None:
                return True  # unknown kind: never collect on a guess
            plural, namespaced = resource
            where = f"namespaces/{ns}/" if namespaced else ""
            assert self._session is not None
            try:
                async with self._session.get(
                    f"{self._upstream}/apis/{api_version}/{where}{plural}/{name}",
                    headers={"Accept-Encoding": "identity"},
                ) as response:
                    if response.status == 404:
                        return False
                    if response.status != 200:
                        return True
                    found = json.loads(await response.read())
            except aiohttp.ClientError:
                return True
        return not uid or found["metadata"].get("uid") == uid

    async def _resource(self, api_version: str, kind: str) -> tuple[str, bool] | None:
        """(plural, namespaced) of a custom kind from the real server's discovery (cached)."""
        if (api_version, kind) not in self._plurals:  # a miss is not cached: CRDs come later
            listing = await self._upstream_json(f"/apis/{api_version}")
            for entry in (listing or {}).get("resources") or []:
                if "/" not in entry["name"]:
                    self._plurals[(api_version, entry["kind"])] = (
                        entry["name"],
                        entry["namespaced"],
                    )
        return self._plurals.get((api_version, kind))


def _line(event: Obj) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


async def _body(request: web.Request) -> Obj:
    if request.content_type not in ("application/json", "application/octet-stream"):
        # kubectl's typed generators (`kubectl create configmap ...`) send protobuf and do not
        # fall back to JSON; `kubectl apply -f` / `create -f` send JSON and work.
        message = f"{request.content_type} bodies are not emulated: use kubectl apply -f"
        raise ApiError(415, "UnsupportedMediaType", message)
    try:
        body = await request.json()
    except ValueError as e:
        raise ApiError(400, "BadRequest", f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", "the body must be a JSON object")
    return body
