"""`Tally` (trainer/recovery/tally.py): every call through it counted, by operation, key kind
and bytes, on a real c10d store, and through a `PrefixStore` over it (as torch's rendezvous
of a process group calls it, from C++)."""

from __future__ import annotations

import torch.distributed as dist

from malleus.trainer.recovery.tally import Tally, key_kind


def test_calls_bytes_and_key_kinds_are_counted() -> None:
    t = Tally(dist.HashStore())
    t.set("rec/12/alive/3", b"abcd")
    t.set("rec/12/alive/4", "xy")
    assert t.get("rec/12/alive/3") == b"abcd"
    assert t.add("rec/12/arrivals", 1) == 1
    assert t.check(["rec/dead/1", "rec/dead/2", "rec/12/leader"]) is False  # one call
    held = t.compare_set("rec/12/leader", b"", b"7")
    assert bytes(held) == b"7"
    got = t.summary()
    assert got["calls"] == {"set": 2, "get": 1, "add": 1, "check": 1, "compare_set": 1}
    assert got["round_trips"] == 6 + 2  # each set is confirmed by a check: two
    assert got["bytes_written"] == 4 + 2 + 1 and got["bytes_read"] == 4 + 1
    assert got["keys"] == {
        "set rec/#/alive/#": 2,
        "get rec/#/alive/#": 1,
        "add rec/#/arrivals": 1,
        "check rec/dead/#": 1,  # a call on many keys of one kind counts once
        "check rec/#/leader": 1,
        "compare_set rec/#/leader": 1,
    }
    assert key_kind("rec/3/pg//0//cpu//0/2") == "rec/#/pg//#//cpu//#/#"


def test_calls_from_a_prefix_store_over_it_are_counted() -> None:
    t = Tally(dist.HashStore())
    p = dist.PrefixStore("rec/2/pg/", t)  # C++ calls the Python store through the trampoline
    p.set("0", "addr")
    assert p.get("0") == b"addr"
    p.wait(["0"])
    assert t.calls["set"] == 1 and t.calls["get"] == 1 and t.calls["wait"] == 1
    assert t.keys["get rec/#/pg//#"] == 1  # PrefixStore joins with a "/"
