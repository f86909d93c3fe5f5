"""What the root-only checks share (`make container-test`, `make cluster-test`)."""
