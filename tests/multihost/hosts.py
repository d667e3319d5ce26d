"""The multi-host tests' module fixture: a cluster of hosts (kvmesh.bench.hosts) and its log."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from kvmesh.bench.hosts import Cluster, leftovers, unavailable


@contextlib.contextmanager
def running_cluster(names: list[str], log_prefix: str) -> Iterator[tuple[Cluster, object]]:
    """A test module's cluster of hosts `names` and the log file its services write to:
    (cluster, log). Fails under CI and skips elsewhere, saying why, where hosts cannot be made.
    On exit everything is removed (and checked to be gone); the log's tail is printed when the
    module failed, and the log is kept at $KVMESH_MULTIHOST_LOG when that is set."""
    import pytest

    why = unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"multi-host tests cannot run here: {why}")
        pytest.skip(f"multi-host tests cannot run here: {why}")
    log = tempfile.NamedTemporaryFile("w+", prefix=log_prefix, suffix=".log", delete=False)
    cluster = Cluster(names)
    ok = False
    try:
        cluster.start()
        yield cluster, log
        ok = True
    finally:
        cluster.close()
        log.flush()
        if not ok:
            log.seek(0)
            print(log.read()[-20000:])
        log.close()
        if os.environ.get("KVMESH_MULTIHOST_LOG"):  # kept for a look after the run
            os.replace(log.name, os.environ["KVMESH_MULTIHOST_LOG"] + "." + log_prefix.strip("-"))
        else:
            os.unlink(log.name)
    assert leftovers() == ([], []), "the cluster left namespaces or links behind"
