"""PrometheusSource's pure parts: the PromQL it sends, how it reads answers, DCGM evidence.

The HTTP side (queries, bearer token, CA bundle) runs against a real Prometheus in
tests/prometheus.
"""

from __future__ import annotations

import math
import urllib.parse

import pytest

from malleus.controller.prometheus import (
    THROTTLE_MASK,
    dcgm_evidence,
    decode_clock_reasons,
    default_queries,
    observation_from_results,
    parse_vector,
    pod_gpu_rank,
    query_url,
)


def vector(*items: tuple[dict[str, str], float | str]) -> dict:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": m, "value": [1700000000.0, str(v)]} for m, v in items],
        },
    }


def test_default_queries_select_the_jobs_pods_and_both_dcgm_label_styles() -> None:
    q = default_queries("ctl-test", namespace="ml")
    scope = 'pod=~"ctl\\\\-test-.*",namespace="ml"'  # only the job's pods in its namespace
    trainer = f'{{malleus_job="ctl-test",{scope}}}'
    assert q.rates == f"max by (rank, pod, namespace) (malleus_gpu_straggling_rate{trainer})"
    assert q.step == f"max(malleus_step{trainer})"
    assert q.generation == f"max(malleus_plan_generation{trainer})"
    # re.escape's backslash is itself escaped inside the PromQL string literal; DCGM's pod is
    # `pod` (honorLabels: true) or `exported_pod` (the GPU Operator's honorLabels: false)
    assert q.sm_clock == (
        f"DCGM_FI_DEV_SM_CLOCK{{{scope}}} or DCGM_FI_DEV_SM_CLOCK"
        '{exported_pod=~"ctl\\\\-test-.*",exported_namespace="ml"}'
    )
    assert q.clock_reasons is not None
    assert q.clock_reasons.startswith("DCGM_FI_DEV_CLOCKS_EVENT_REASONS{")
    assert default_queries("j", sm_clock_metric=None).sm_clock is None


def test_query_url_encodes_the_promql() -> None:
    url = query_url("http://prom:9090/", 'max(up{job="x"})')
    assert url.startswith("http://prom:9090/api/v1/query?query=")
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(url).query) == {
        "query": ['max(up{job="x"})']
    }


def test_parse_vector_scalar_and_errors() -> None:
    assert parse_vector(vector(({"rank": "3"}, 2.5), ({"rank": "4"}, "NaN"))) == [
        ({"rank": "3"}, 2.5),
        ({"rank": "4"}, pytest.approx(math.nan, nan_ok=True)),
    ]
    assert parse_vector(
        {"status": "success", "data": {"resultType": "scalar", "result": [0, "7"]}}
    ) == [({}, 7.0)]
    with pytest.raises(RuntimeError, match="bad_data: parse error"):
        parse_vector({"status": "error", "errorType": "bad_data", "error": "parse error"})
    with pytest.raises(RuntimeError, match="matrix"):
        parse_vector({"status": "success", "data": {"resultType": "matrix", "result": []}})


def test_observation_from_results() -> None:
    rates = parse_vector(vector(({"rank": "3"}, 2.5), ({"rank": "5"}, "NaN"), ({}, 9.0)))
    obs = observation_from_results(
        rates,
        parse_vector(vector(({}, 41))),
        parse_vector(vector(({}, 16.5))),
        parse_vector(vector(({}, 2))),
        {3: "throttled: hw_thermal_slowdown"},
    )
    assert obs is not None
    assert (obs.step, obs.step_seconds, obs.generation) == (41, 16.5, 2)
    assert obs.rates == {3: 2.5, 5: None}
    assert obs.evidence == {3: "throttled: hw_thermal_slowdown"}
    assert observation_from_results(rates, [], [], []) is None  # no step reported yet


def test_clock_reasons_and_dcgm_evidence() -> None:
    assert decode_clock_reasons(0x44) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert THROTTLE_MASK & 0x1 == 0  # idle is not throttling
    rank_of = pod_gpu_rank(4)
    assert rank_of({"pod": "ctl-test-worker-1", "gpu": "2"}) == 6
    assert rank_of({"pod": "prometheus", "gpu": "0"}) is None
    assert rank_of({"pod": "ctl-test-worker-0"}) is None
    # honorLabels: false: `pod` is the exporter's own pod, the workload's is `exported_pod`
    assert rank_of({"pod": "dcgm-exporter-7", "exported_pod": "ctl-test-worker-1", "gpu": "1"}) == 5
    clocks = [
        ({"pod": "ctl-test-worker-0", "gpu": "0"}, 1980.0),
        ({"pod": "ctl-test-worker-0", "gpu": "3"}, 1200.0),
        ({"pod": "ctl-test-worker-1", "gpu": "0"}, 1900.0),  # within 10 % of the fastest
    ]
    reasons = [
        ({"pod": "ctl-test-worker-0", "gpu": "0"}, 0x1),  # idle only
        ({"pod": "ctl-test-worker-0", "gpu": "3"}, 0x40 | 0x1),
        ({"pod": "ctl-test-worker-0", "gpu": "1"}, 0x4),
    ]
    assert dcgm_evidence(clocks, reasons, rank_of) == {
        1: "throttled: sw_power_cap",
        3: "SM clock 1200 MHz, 61% of the job's fastest; throttled: hw_thermal_slowdown",
    }


def test_step_and_generation_come_from_the_coordinator_pod_alone() -> None:
    """A worker pod of the job cannot inflate the step or the plan generation through max()."""
    q = default_queries("ctl-test", namespace="ml", coordinator_pod="ctl-test-node-0")
    owner = '{malleus_job="ctl-test",pod="ctl-test-node-0",namespace="ml"}'
    assert q.step == f"max(malleus_step{owner})"
    assert q.step_seconds == f"max(malleus_step_seconds{owner})"
    assert q.generation == f"max(malleus_plan_generation{owner})"
    assert 'pod=~"ctl\\\\-test-.*"' in q.rates  # rates still come from every pod of the job
