"""The control endpoint under a crowd and under garbage: every request answered, quickly, with
a 4xx naming what is wrong, never a 500, a hang, a reset or a dead handler thread.

One real `ControlServer` (rank 0 of a 4-rank job with emulation, so all three writes exist)
over real sockets, driven by raw `http.client` so that the bodies are exactly what is sent.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from malleus.planner.problem import PlanningProblem
from malleus.trainer.endpoint.server import MAX_DEPTH, ControlServer
from malleus.trainer.engine.services import Services, WorkerState
from malleus.trainer.measure.emulation import InjectionQueue
from malleus.trainer.switching.plan_inbox import PlanInbox
from malleus.trainer.switching.protocol import StopControl
from tests.trainer.conftest import make_plan

TOKEN = "s3cret-token"
WORLD = 4
ANSWER_SECONDS = 1.0
"""Every answer to a bad body arrives within this (the issue's bound), on a loaded machine."""


class Endpoint:
    """Rank 0's endpoint of a 4-rank emulated job, and raw requests to it."""

    def __init__(self) -> None:
        problem = PlanningProblem.load(
            {
                "nodes": 1,
                "gpus_per_node": WORLD,
                "model": {"layers": 4, "tp": 2},
                "micro_batches": 4,
            }
        )
        services = Services(
            WorkerState("demo", world=WORLD, steps=10),
            inbox=PlanInbox(problem, current_generation=1),
            stop=StopControl(),
        )
        services.state.update(generation=1)
        self.injections = InjectionQueue()
        assert services.stop is not None
        self.server = ControlServer(
            "127.0.0.1",
            0,
            TOKEN,
            status=services.status,
            inbox=services.inbox,
            metrics=None,
            inject=self.injections.put,
            stop=services.stop.request,
        )

    def request(
        self, method: str, path: str, body: bytes = b"", token: str | None = TOKEN
    ) -> tuple[int, Any, float]:
        """(code, decoded JSON answer or text, seconds taken)."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        started = time.monotonic()
        try:
            # The endpoint answers a refused request from its head and reads at most a bounded
            # part of its body (trainer/endpoint/intake.py): it may close while the rest is
            # still being sent. Its answer was sent first: read it.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.request(method, path, body=body if method == "POST" else None, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        elapsed = time.monotonic() - started
        try:
            return response.status, json.loads(raw), elapsed
        except ValueError:
            return response.status, raw.decode(errors="replace"), elapsed


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    with e.server:
        yield e


def test_two_hundred_concurrent_clients_are_all_answered(endpoint: Endpoint) -> None:
    """All connect at once: with the stdlib's listen backlog of 5, most of them timed out."""
    clients = 200
    barrier = threading.Barrier(clients)

    def healthz(_: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", endpoint.server.port, timeout=2)
        try:
            barrier.wait()
            conn.request("GET", "/healthz")
            return conn.getresponse().status
        finally:
            conn.close()

    with ThreadPoolExecutor(clients) as pool:
        codes = list(pool.map(healthz, range(clients)))
    assert codes == [200] * clients


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("path", "body", "field", "words"),
    [
        ("/plan", DEEP, "", f"nests deeper than {MAX_DEPTH}"),
        ("/stop", DEEP, "", "nests deeper"),
        ("/inject", DEEP, "", "nests deeper"),
        ("/inject", b'{"a":' * 40 + b"1" + b"}" * 40, "", "nests deeper"),
        ("/inject", b'{"rank": 1000000, "factor": 2}', "rank", "from 0 to 3"),
        ("/inject", b'{"rank": -1, "factor": 2}', "rank", "from 0 to 3"),
        ("/inject", b'{"rank": 1.0, "factor": 2}', "rank", "integer"),
        ("/inject", b'{"rank": true, "factor": 2}', "rank", "integer"),
        ("/inject", b'{"rank": 1, "factor": 1e12}', "factor", "from 1 (healthy) to 1000"),
        ("/inject", b'{"rank": 1, "factor": 1e400}', "factor", "inf"),
        ("/inject", b'{"rank": 1, "factor": 0.5}', "factor", "from 1"),
        ("/inject", b'{"rank": 1, "factor": "2"}', "factor", "'2'"),
        ("/inject", b'{"rank": 1, "factor": 1' + b"0" * 4000 + b"}", "factor", "..."),
        ("/inject", b'{"rank": 1, "factor": NaN}', "", "NaN is not a JSON number"),
        ("/inject", b'{"rank": 1}', "factor", 'required: send exactly {"rank"'),
        ("/inject", b'{"rank": 1, "factor": 2, "x": 0}', "x", "unknown field"),
        ("/inject", b"[1, 2]", "", "expected a JSON object, got list"),
        ("/plan", b'{"generation": 1' + b"0" * 5000 + b"}", "", "not JSON"),
        ("/plan", b"\xff\xfe{}", "", "not UTF-8"),
        ("/plan", b'{"generation": "two"}', "generation", "integer"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(
    endpoint: Endpoint, path: str, body: bytes, field: str, words: str
) -> None:
    code, answer, seconds = endpoint.request("POST", path, body)
    assert code == 400, answer
    paths = [f["path"] for f in answer["faults"]]
    said = " ".join([answer["error"], *(f["message"] for f in answer["faults"])])
    assert field in paths and words in said, answer
    assert seconds < ANSWER_SECONDS
    assert endpoint.injections.drain() == {}  # nothing was acted on


def test_a_good_injection_still_lands_and_the_stop_names_its_field(endpoint: Endpoint) -> None:
    code, answer, _ = endpoint.request("POST", "/inject", b'{"rank": 3, "factor": 1000}')
    assert (code, answer) == (200, {"rank": 3, "factor": 1000.0})
    assert endpoint.injections.drain() == {3: 1000.0}
    code, answer, _ = endpoint.request("POST", "/stop", b'{"checkpoint": "yes"}')
    assert code == 400 and "checkpoint: 'yes'" in answer["error"]


def test_oversize_bodies_are_413_and_garbage_needs_the_token_first(endpoint: Endpoint) -> None:
    code, answer, seconds = endpoint.request("POST", "/plan", b" " * ((1 << 20) + 1))
    assert code == 413 and "exceeds the limit" in answer["error"] and seconds < ANSWER_SECONDS
    code, answer, _ = endpoint.request("POST", "/inject", DEEP, token=None)
    assert code == 401  # an unauthenticated body is not even parsed
    code, answer, _ = endpoint.request("POST", "/inject", b'{"rank": 1, "factor": 2}', token="x")
    assert code == 401 and endpoint.injections.drain() == {}


# ---- property-based: whatever the body, a clear answer, quickly, and a live server --------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python writes them: not JSON


def _shaped(good: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """`good` with each field kept, dropped or replaced by anything, and extra keys at times."""
    fields = {k: st.one_of(st.just(v), _json) for k, v in good.items()}
    return st.builds(
        lambda kept, values, extra: _dumps({**{k: values[k] for k in kept}, **extra}),
        st.sets(st.sampled_from(sorted(good))),
        st.fixed_dictionaries(fields),
        st.dictionaries(st.text(max_size=8), _json, max_size=2),
    )


_bodies = st.one_of(
    _json.map(_dumps),
    st.binary(max_size=64),
    st.integers(min_value=1, max_value=200_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(min_value=1, max_value=200_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(min_value=300, max_value=6000).map(
        lambda n: b'{"rank": 1, "factor": 9' + b"9" * n + b"}"
    ),
    _shaped(make_plan(2)),
    _shaped({"rank": 1, "factor": 2.0}),
    _shaped({"checkpoint": False}),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(["/plan", "/inject", "/stop"]),
    body=_bodies,
    token=st.sampled_from([TOKEN, TOKEN, TOKEN, None, "wrong"]),
)
def test_fuzzed_bodies_get_a_clear_answer_quickly(
    endpoint: Endpoint, path: str, body: bytes, token: str | None
) -> None:
    code, answer, seconds = endpoint.request("POST", path, body, token)
    assert code in (200, 202, 400, 401, 409, 413), (code, answer)
    assert seconds < ANSWER_SECONDS, (path, body[:80], seconds)
    if code == 400:  # a reason, not a traceback
        assert isinstance(answer["error"], str) and answer["error"], answer
    assert endpoint.request("GET", "/healthz")[0] == 200
    endpoint.injections.drain()
