"""A real Prometheus for the tests: config written here, binary from MALLEUS_PROMETHEUS.

`Prometheus` starts `prometheus` on a free loopback port with a 1 s scrape interval, optionally
serving HTTPS (its own `--web.config.file` TLS), and `wait_for` polls the query API until a
PromQL expression has an answer: bounded waits, no sleeps that hope.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ports import free_port

__all__ = ["Prometheus", "binary", "serve_text"]


def binary(var: str) -> str:
    """The executable named by environment variable `var`, or a skip that says why."""
    path = os.environ.get(var)
    if not path:
        pytest.skip(
            f"{var} is not set (scripts/prometheus-bin.sh provides it; scripts/test.sh sets it)"
        )
    if not os.access(path, os.X_OK):
        pytest.fail(f"{var}={path} is not an executable")
    return path


@contextmanager
def serve_text(pages: Mapping[str, Callable[[], bytes]]) -> Iterator[str]:
    """An HTTP server on loopback answering each path of `pages` with its text (an exporter)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            page = pages.get(self.path)
            body = page() if page is not None else b"not found\n"
            self.send_response(200 if page is not None else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class Prometheus:
    """One prometheus process over `scrape_configs`; `tls` = (cert PEM, key PEM) serves HTTPS;
    `port`: listen there (one a client was told before the server started), else a free one."""

    def __init__(
        self,
        exe: str,
        workdir: Path,
        scrape_configs: list[dict[str, Any]],
        *,
        tls: tuple[str, str] | None = None,
        ca_pem: str | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}}
        config["scrape_configs"] = scrape_configs  # type: ignore[assignment]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        args = [
            exe,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self._ssl: ssl.SSLContext | None = None
        if tls is not None:
            (workdir / "tls.crt").write_text(tls[0])
            (workdir / "tls.key").write_text(tls[1])
            web = {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"}}
            (workdir / "web.yml").write_text(yaml.safe_dump(web))
            args.append(f"--web.config.file={workdir / 'web.yml'}")
            self._ssl = ssl.create_default_context(cadata=ca_pem)
        self.url = f"{'https' if tls else 'http'}://localhost:{self.port}"
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self._proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self.workdir = workdir

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5, context=self._ssl) as resp:
            return list(json.loads(resp.read())["data"]["result"])

    def wait_for(self, promql: str, count: int = 1, timeout: float = 20.0) -> list[dict[str, Any]]:
        """The answer to `promql` once it has `count` series or more (polled every 0.2 s)."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_tail()}")
            try:
                result = self.query(promql)
                if len(result) >= count:
                    return result
                last = result
            except OSError as e:  # not listening yet
                last = e
            time.sleep(0.2)
        raise AssertionError(f"{promql!r}: {last!r} after {timeout} s\n{self.log_tail()}")

    def log_tail(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._log.close()
