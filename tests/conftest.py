"""Suite-wide fixtures: the real Kubernetes API server harness (skips without MALLEUS_K8S_ASSETS)."""

pytest_plugins = ["tests.k8s.fixtures", "tests.cluster.fixtures"]
