"""The trainer's control endpoint: the HTTP server, its body parsing, its credentials and
the Prometheus metrics it serves.

Holds: `server.py` (health, status, metrics, plans, stop, injections), `body.py` (judging a write
body before anything acts on it), `credentials.py` (address, TLS identity, token),
`metrics.py` (the trainer's metrics and a reader of their exposition).

May import: every room below it (`world` .. `switching`), and `malleus.control`.
"""
