"""An in-memory core API (``/api/v1``) for the test cluster: what apiextensions-apiserver lacks.

The real CRD server has no Pods, Services, ConfigMaps, Secrets, Events or Namespaces, yet kopf,
the operator and kubectl need them. ``CoreStore`` keeps those objects with the server-side
behaviour clients depend on: uid / resourceVersion / generation / creationTimestamp stamped on
create, resourceVersion bumped on every real change (kopf guards its JSON patches with a ``test``
of ``/metadata/resourceVersion``; a no-op patch changes nothing, as on a real server), label and
field selectors, merge and JSON patches, the status subresource, finalizers, and a change history
that watches replay from a resourceVersion (410 Expired when it is too old).

It is thread-safe: the proxy serves it from its event-loop thread while tests read it, change pod
phases and wait on it from theirs. No kubelet, scheduler or controllers run: a pod stays
``Pending`` until a test sets its phase, and deletion is immediate unless finalizers hold it.

Why not kmock (its `KubernetesEmulator`, 0.8, serves the operator's unit tests in
``tests/operator/kube.py``): the end-to-end tests put kopf, kubectl and `LocalKubelet` on this
core API, and they need what kmock does not do: resourceVersions on objects and lists and
watches that resume from one (kmock answers ``resourceVersion: "..."`` and replays everything);
field selectors (``kubectl describe`` lists Events by ``involvedObject.*``) and label selectors
on lists and watches; server-side Tables for ``kubectl get``; uid / creationTimestamp stamping;
strategic-merge and JSON patches; and an in-process subscription the kubelet can follow from
its own thread (kmock's objects live on its server's event loop).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime as dt
import itertools
import queue
import re
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "KINDS",
    "ApiError",
    "CoreStore",
    "Kind",
    "field_matcher",
    "json_patch",
    "label_matcher",
    "merge_patch",
    "table",
]

Obj = dict[str, Any]
Listener = Callable[[str, Obj], None]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Kind:
    """One core resource type, as discovery (``/api/v1``) describes it."""

    plural: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    status: bool = False  # served with a /status subresource (the main resource ignores status)
    categories: tuple[str, ...] = ()
    delete_returns_object: bool = False  # else a Status (what the generated clients expect)


KINDS: dict[str, Kind] = {
    k.plural: k
    for k in (
        Kind("namespaces", "Namespace", False, ("ns",), status=True),
        Kind("pods", "Pod", True, ("po",), True, ("all",), delete_returns_object=True),
        Kind("services", "Service", True, ("svc",), True, ("all",), delete_returns_object=True),
        Kind("configmaps", "ConfigMap", True, ("cm",)),
        Kind("secrets", "Secret", True),
        Kind("events", "Event", True, ("ev",)),
        Kind("serviceaccounts", "ServiceAccount", True, ("sa",), delete_returns_object=True),
        Kind("persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), True, (), True),
    )
}

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_PROTECTED_META = ("uid", "creationTimestamp", "name", "namespace", "deletionTimestamp")


class ApiError(Exception):
    """A failure the API answers with a ``Status`` object (404, 409, 410, 422, ...)."""

    def __init__(self, code: int, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _not_found(plural: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{plural} "{name}" not found', name=name, kind=plural)


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- selectors ------------------------------------------------------------------------------


def _split_terms(text: str) -> list[str]:
    """Split a selector on commas outside parentheses (``a in (x,y),b`` -> two terms)."""
    terms, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    terms.append(current.strip())
    return [t for t in terms if t]


_SET_TERM = re.compile(r"^([\w./-]+)\s+(in|notin)\s+\((.*)\)$")
_EQ_TERM = re.compile(r"^([\w./-]+)\s*(==|=|!=)\s*(.*)$")


def label_matcher(selector: str | None) -> Callable[[Obj], bool]:
    """A predicate for a label selector (equality, ``in``/``notin``, ``key``, ``!key``)."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(selector or ""):
        if m := _SET_TERM.match(term):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",")}
            if op == "in":
                tests.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif m := _EQ_TERM.match(term):
            key, op, value = m[1], m[2], m[3].strip()
            if op == "!=":
                tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            tests.append(lambda labels, k=absent: k not in labels)
        elif re.fullmatch(r"[\w./-]+", term):
            tests.append(lambda labels, k=term: k in labels)
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")

    def match(obj: Obj) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(test(labels) for test in tests)

    return match


def _field(obj: Obj, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return str(value).lower()
    return "" if value is None else str(value)


def field_matcher(selector: str | None) -> Callable[[Obj], bool]:
    """A predicate for a field selector: ``path=value`` / ``path!=value`` on any dotted path.

    Real servers allow a few paths per kind (``metadata.name``, ``involvedObject.uid``, ...);
    allowing any path is a superset that keeps this small. A missing field reads as ``""``.
    """
    tests: list[tuple[str, bool, str]] = []
    for term in _split_terms(selector or ""):
        m = _EQ_TERM.match(term)
        if m is None:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        tests.append((m[1], m[2] != "!=", m[3].strip()))
    return lambda obj: all((_field(obj, p) == v) == eq for p, eq, v in tests)


# ---- patches --------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 JSON merge patch; ``strategic`` drops SMP directives (``$setElementOrder/...``).

    Strategic merge patches are otherwise applied as merge patches: lists are replaced, not
    merged by key. Enough for kubectl label/annotate/apply of the simple objects tests use.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if strategic and key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value, strategic)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _step(container: Any, key: str) -> Any:
    try:
        return container[int(key)] if isinstance(container, list) else container[key]
    except (KeyError, IndexError, ValueError, TypeError):
        raise ApiError(422, "Invalid", f"JSON patch: path element {key!r} not found") from None


def json_patch(doc: Any, ops: list[Obj]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test); a failed test is a 422."""
    doc = copy.deepcopy(doc)

    def get(path: list[str]) -> Any:
        value = doc
        for key in path:
            value = _step(value, key)
        return value

    def remove(path: list[str]) -> Any:
        parent = get(path[:-1])
        _step(parent, path[-1])
        return parent.pop(int(path[-1]) if isinstance(parent, list) else path[-1])

    def add(path: list[str], value: Any) -> None:
        nonlocal doc
        if not path:
            doc = value
            return
        parent, key = get(path[:-1]), path[-1]
        if isinstance(parent, list):
            parent.insert(len(parent) if key == "-" else int(key), value)
        elif isinstance(parent, dict):
            parent[key] = value
        else:
            raise ApiError(422, "Invalid", f"JSON patch: cannot add to {path}")

    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
    for op in ops:
        name, path = op.get("op"), _pointer(op.get("path", ""))
        if name == "test":
            if get(path) != op.get("value"):
                raise ApiError(422, "Invalid", f"JSON patch: test failed at {op['path']}")
        elif name == "remove":
            remove(path)
        elif name == "add":
            add(path, copy.deepcopy(op["value"]))
        elif name == "replace":
            remove(path)
            add(path, copy.deepcopy(op["value"]))
        elif name in ("move", "copy"):
            source = _pointer(op["from"])
            value = remove(source) if name == "move" else copy.deepcopy(get(source))
            add(path, value)
        else:
            raise ApiError(422, "Invalid", f"JSON patch: unknown op {name!r}")
    return doc


# ---- the store ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Change:
    rv: int
    plural: str
    namespace: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj  # never mutated after it is recorded
    old: Obj | None  # the previous state, for selector transitions in watches


@dataclass
class _Watcher:
    plural: str
    namespace: str | None
    match: Callable[[Obj], bool]
    callback: Listener


def _see(change: _Change, watcher: _Watcher) -> tuple[str, Obj] | None:
    """What a selective watch sees of a change: leaving the selection reads as DELETED."""
    if change.plural != watcher.plural or watcher.namespace not in (None, change.namespace):
        return None
    now = watcher.match(change.obj)
    before = change.old is not None and watcher.match(change.old)
    if change.type == "MODIFIED" and now != before:
        return ("ADDED" if now else "DELETED"), change.obj
    return (change.type, change.obj) if now else None


class CoreStore:
    """Core-API objects keyed by (plural, namespace, name), with a bounded change history."""

    def __init__(self, history: int = 20000) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._history: deque[_Change] = deque(maxlen=history)
        self._watchers: list[_Watcher] = []
        self._rv = itertools.count(1000)
        self._last_rv = 999
        self._ips = itertools.count(10)
        for name in ("default", "kube-system", "kube-public"):
            self.create("namespaces", "", {"metadata": {"name": name}})

    # -- reading ------------------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        """The latest resourceVersion (what a list returns, and a watch may start from)."""
        return str(self._last_rv)

    def get(self, plural: str, namespace: str, name: str) -> Obj:
        """A deep copy of one object; ``ApiError`` 404 when absent."""
        with self._lock:
            obj = self._objects.get((self._kind(plural).plural, self._ns(plural, namespace), name))
            if obj is None:
                raise _not_found(plural, name)
            return copy.deepcopy(obj)

    def list(
        self,
        plural: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[Obj]:
        """Matching objects (deep copies), sorted by namespace and name; all namespaces if None."""
        match = self._matcher(label_selector, field_selector)
        with self._lock:
            self._kind(plural)
            return [
                copy.deepcopy(obj)
                for (p, ns, _), obj in sorted(self._objects.items())
                if p == plural and namespace in (None, ns) and match(obj)
            ]

    def list_body(
        self,
        plural: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> Obj:
        """The ``<Kind>List`` a list request answers, consistent with its resourceVersion.

        Items omit kind and apiVersion, as a real server's do (clients take them from the list).
        """
        with self._lock:
            items = self.list(plural, namespace, label_selector, field_selector)
            version = self.resource_version
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{KINDS[plural].kind}List",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": version, "continue": ""},
            "items": items,
        }

    # -- writing ------------------------------------------------------------------------------

    def create(self, plural: str, namespace: str, body: Obj) -> Obj:
        """Create an object (``generateName`` honoured), stamping metadata and kind defaults."""
        kind = self._kind(plural)
        namespace = self._ns(plural, namespace)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if kind.namespaced and not namespace:
            raise ApiError(400, "BadRequest", f"{kind.kind} needs a namespace")
        if kind.namespaced and (meta.get("namespace") or namespace) != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on "
                "the request",
            )
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + "".join(
                    secrets.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5)
                )
            name = meta.get("name") or ""
            if not _NAME.match(name) or len(name) > 253:
                raise ApiError(422, "Invalid", f"{kind.kind} {name!r} is invalid: metadata.name")
            key = (plural, namespace, name)
            if key in self._objects:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{plural} "{name}" already exists',
                    name=name,
                    kind=plural,
                )
            if kind.namespaced and ("namespaces", "", namespace) not in self._objects:
                self.create("namespaces", "", {"metadata": {"name": namespace}})
            for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
                meta.pop(field, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
            if kind.namespaced:
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            obj.update(apiVersion="v1", kind=kind.kind)
            self._defaults(kind, obj)
            return self._record(key, "ADDED", obj, None)

    def replace(
        self, plural: str, namespace: str, name: str, body: Obj, status: bool = False
    ) -> Obj:
        """PUT: replace the object (or only its status); a stale resourceVersion is a 409."""
        with self._lock:
            old = self.get(plural, namespace, name)
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent and sent != old["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {plural} "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    name=name,
                    kind=plural,
                )
            return self._update(plural, old, copy.deepcopy(body), status)

    def patch(
        self,
        plural: str,
        namespace: str,
        name: str,
        patch: Any,
        patch_type: str = "merge",
        status: bool = False,
    ) -> Obj:
        """Patch: ``patch_type`` is ``merge``, ``strategic`` (applied as merge) or ``json``."""
        with self._lock:
            old = self.get(plural, namespace, name)
            if patch_type == "json":
                new = json_patch(old, patch)
            elif patch_type in ("merge", "strategic"):
                if not isinstance(patch, dict):
                    raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
                new = merge_patch(old, patch, strategic=patch_type == "strategic")
            else:
                raise ApiError(415, "UnsupportedMediaType", f"patch type {patch_type!r}")
            return self._update(plural, old, new, status)

    def delete(self, plural: str, namespace: str, name: str) -> Obj:
        """Delete now, or mark ``deletionTimestamp`` while finalizers remain; returns the object.

        Deleting a namespace deletes the core objects in it (the namespace controller's job).
        """
        with self._lock:
            obj = self.get(plural, namespace, name)
            if obj["metadata"].get("finalizers"):
                if obj["metadata"].get("deletionTimestamp"):
                    return obj
                obj["metadata"].update(deletionTimestamp=now_iso(), deletionGracePeriodSeconds=0)
                return self._record(self._key(plural, obj), "MODIFIED", obj, self._old(plural, obj))
            if plural == "namespaces":
                for other in list(self._objects):
                    if other[0] != "namespaces" and other[1] == name:
                        self.delete(other[0], other[1], other[2])
            return self._record(self._key(plural, obj), "DELETED", obj, None)

    def delete_collection(
        self,
        plural: str,
        namespace: str | None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[Obj]:
        """Delete every matching object; returns them as deleted (or marked for deletion)."""
        with self._lock:
            return [
                self.delete(plural, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
                for obj in self.list(plural, namespace, label_selector, field_selector)
            ]

    # -- watching -----------------------------------------------------------------------------

    def subscribe(
        self,
        plural: str,
        namespace: str | None,
        since: str | None,
        callback: Listener,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[tuple[str, Obj]], Callable[[], None]]:
        """Start a watch: (events to send first, unsubscribe); later ones go to ``callback``.

        ``since`` None, "" or "0" starts with ADDED for every current object; a resourceVersion
        replays the changes after it, or raises 410 Expired when the history no longer holds it.
        The callback runs under the store's lock, on the writer's thread: it must only enqueue.
        """
        self._kind(plural)
        watcher = _Watcher(
            plural, namespace, self._matcher(label_selector, field_selector), callback
        )
        with self._lock:
            if since in (None, "", "0"):
                first = [("ADDED", obj) for obj in self.list(plural, namespace)]
                first = [(t, o) for t, o in first if watcher.match(o)]
            else:
                try:
                    start = int(str(since))
                except ValueError:
                    raise ApiError(
                        400, "BadRequest", f"invalid resourceVersion {since!r}"
                    ) from None
                oldest = self._history[0].rv if self._history else self._last_rv + 1
                if start < oldest - 1:
                    raise ApiError(410, "Expired", f"too old resource version: {start} ({oldest})")
                first = [
                    seen
                    for change in self._history
                    if change.rv > start and (seen := _see(change, watcher)) is not None
                ]
            self._watchers.append(watcher)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._watchers.remove(watcher)

        return first, unsubscribe

    def watch(
        self,
        plural: str,
        namespace: str | None = None,
        since: str | None = None,
        timeout: float = 10.0,
        label_selector: str | None = None,
    ) -> Iterator[tuple[str, Obj]]:
        """Yield (type, object) for the test thread until ``timeout`` s pass without an event."""
        events: queue.Queue[tuple[str, Obj]] = queue.Queue()
        first, unsubscribe = self.subscribe(
            plural, namespace, since, lambda t, o: events.put((t, o)), label_selector
        )
        try:
            for event_type, obj in first:
                yield event_type, copy.deepcopy(obj)
            while True:
                try:
                    event_type, obj = events.get(timeout=timeout)
                except queue.Empty:
                    return
                yield event_type, copy.deepcopy(obj)
        finally:
            unsubscribe()

    def wait_for(self, probe: Callable[[], _T | None], timeout: float = 10.0, what: str = "") -> _T:
        """Re-run ``probe`` after every change until it returns non-None; TimeoutError after."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while (result := probe()) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{what or probe!r}: not reached in {timeout:.0f} s")
                self._changed.wait(remaining)
            return result

    # -- conveniences for tests ---------------------------------------------------------------

    def set_pod_status(self, namespace: str, name: str, **status: Any) -> Obj:
        """Merge fields into a pod's status (what a kubelet would report)."""
        return self.patch("pods", namespace, name, {"status": status}, status=True)

    def set_pod_phase(self, namespace: str, name: str, phase: str, **status: Any) -> Obj:
        """Set ``status.phase`` (and a matching Ready condition), e.g. Running / Failed."""
        ready = "True" if phase == "Running" else "False"
        condition = {"type": "Ready", "status": ready, "lastTransitionTime": now_iso()}
        return self.set_pod_status(namespace, name, phase=phase, conditions=[condition], **status)

    # -- internals ----------------------------------------------------------------------------

    def _kind(self, plural: str) -> Kind:
        try:
            return KINDS[plural]
        except KeyError:
            raise ApiError(
                404, "NotFound", f"the server could not find resource {plural!r}"
            ) from None

    def _ns(self, plural: str, namespace: str | None) -> str:
        return (namespace or "") if self._kind(plural).namespaced else ""

    def _key(self, plural: str, obj: Obj) -> tuple[str, str, str]:
        meta = obj["metadata"]
        return (plural, self._ns(plural, meta.get("namespace")), meta["name"])

    def _old(self, plural: str, obj: Obj) -> Obj:
        return self._objects[self._key(plural, obj)]

    @staticmethod
    def _matcher(label_selector: str | None, field_selector: str | None) -> Callable[[Obj], bool]:
        labels, fields = label_matcher(label_selector), field_matcher(field_selector)
        return lambda obj: labels(obj) and fields(obj)

    def _defaults(self, kind: Kind, obj: Obj) -> None:
        """What the real registry strategies set on create (only what tests are likely to read)."""
        if kind.status:
            obj["status"] = {}
        if kind.kind == "Pod":
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif kind.kind == "Namespace":
            obj["status"] = {"phase": "Active"}
        elif kind.kind == "Service":
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if spec.get("clusterIP") != "None":
                ip = next(self._ips)
                spec["clusterIP"] = f"10.96.{ip // 250}.{ip % 250 + 1}"
            spec["clusterIPs"] = [spec["clusterIP"]]
        elif kind.kind == "Secret":
            obj.setdefault("type", "Opaque")
            for key, value in (obj.pop("stringData", None) or {}).items():
                obj.setdefault("data", {})[key] = base64.b64encode(value.encode()).decode()

    def _update(self, plural: str, old: Obj, new: Obj, status: bool) -> Obj:
        """Apply a new state: keep immutable metadata, split status, bump rv / generation."""
        kind = self._kind(plural)
        if status:  # the status subresource changes only .status
            new = {**old, "status": new.get("status", {})}
        elif kind.status:  # the main resource leaves .status alone
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        meta = new.setdefault("metadata", {})
        for field in _PROTECTED_META:
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        meta["generation"] = old["metadata"].get("generation", 1)
        new.update(apiVersion="v1", kind=kind.kind)
        if new == old:
            return old  # no-op: no new resourceVersion, no watch event
        body = {k: v for k, v in new.items() if k not in ("metadata", "status")}
        if body != {k: v for k, v in old.items() if k not in ("metadata", "status")}:
            meta["generation"] += 1
        key = self._key(plural, old)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._record(key, "DELETED", new, None)
        return self._record(key, "MODIFIED", new, self._objects[key])

    def _record(self, key: tuple[str, str, str], event_type: str, obj: Obj, old: Obj | None) -> Obj:
        """Store (or drop) the object under a new resourceVersion and tell the watchers."""
        rv = next(self._rv)
        self._last_rv = rv
        obj["metadata"]["resourceVersion"] = str(rv)
        if event_type == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        change = _Change(rv, key[0], key[1], event_type, obj, old)
        self._history.append(change)
        for watcher in list(self._watchers):
            if (seen := _see(change, watcher)) is not None:
                watcher.callback(*seen)
        self._changed.notify_all()
        return copy.deepcopy(obj)


# ---- kubectl tables -------------------------------------------------------------------------


def _age(stamp: str | None) -> str:
    if not stamp:
        return "<unknown>"
    then = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    seconds = max(0, int((dt.datetime.now(dt.UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _pod_cells(obj: Obj) -> list[Any]:
    status = obj.get("status") or {}
    containers = (obj.get("spec") or {}).get("containers") or []
    ready = sum(1 for c in status.get("containerStatuses") or [] if c.get("ready"))
    phase = "Terminating" if obj["metadata"].get("deletionTimestamp") else status.get("phase", "")
    return [f"{ready}/{len(containers)}", phase, 0]


_COLUMNS: dict[str, tuple[list[tuple[str, str]], Callable[[Obj], list[Any]]]] = {
    "pods": ([("Ready", "string"), ("Status", "string"), ("Restarts", "integer")], _pod_cells),
    "services": (
        [("Type", "string"), ("Cluster-IP", "string")],
        lambda o: [o.get("spec", {}).get("type", ""), o.get("spec", {}).get("clusterIP", "")],
    ),
    "configmaps": ([("Data", "integer")], lambda o: [len(o.get("data") or {})]),
    "secrets": (
        [("Type", "string"), ("Data", "integer")],
        lambda o: [o.get("type", ""), len(o.get("data") or {})],
    ),
    "namespaces": ([("Status", "string")], lambda o: [(o.get("status") or {}).get("phase", "")]),
    "events": (
        [("Type", "string"), ("Reason", "string"), ("Object", "string"), ("Message", "string")],
        lambda o: [
            o.get("type", ""),
            o.get("reason", ""),
            f"{_field(o, 'involvedObject.kind').lower()}/{_field(o, 'involvedObject.name')}",
            o.get("message", ""),
        ],
    ),
}


def table(plural: str, objects: list[Obj], resource_version: str) -> Obj:
    """A ``meta.k8s.io/v1`` Table, which ``kubectl get`` asks for (server-side printing)."""
    extra, cells = _COLUMNS.get(plural, ([], lambda o: []))
    columns = [("Name", "string"), *extra, ("Age", "string")]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [
            {
                "name": n,
                "type": t,
                "format": "name" if n == "Name" else "",
                "description": "",
                "priority": 0,
            }
            for n, t in columns
        ],
        "rows": [
            {
                "cells": [
                    o["metadata"]["name"],
                    *cells(o),
                    _age(o["metadata"].get("creationTimestamp")),
                ],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": o["metadata"],
                },
            }
            for o in objects
        ],
    }
