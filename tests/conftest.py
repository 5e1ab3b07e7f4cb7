"""Suite-wide fixtures: the real Kubernetes control plane (tests/cluster; skips without MALLEUS_K8S_ASSETS)."""

pytest_plugins = ["tests.cluster.fixtures"]
