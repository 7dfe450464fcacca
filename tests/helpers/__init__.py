"""What the tests share beyond conftest.py: a loopback cluster, many jobs in one launch, the host-sync counter."""
