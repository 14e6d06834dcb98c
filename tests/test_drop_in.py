"""torch's sampler contract: isinstance and attributes, and a process that stops mid-epoch exits promptly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from croupier.client import DistributedSampler
from croupier.server import Server


def test_an_instance_of_torchs_distributed_sampler_with_its_attributes(server: Server) -> None:
    """Frameworks decide by isinstance whether a loader is already sharded, and read these attributes."""
    data = list(range(10))
    s = DistributedSampler(data, num_replicas=3, rank=2, shuffle=False, seed=5, address=server.address,
                           job="attrs", token="t")
    t = TorchSampler(data, num_replicas=3, rank=2, shuffle=False, seed=5)
    assert isinstance(s, TorchSampler)
    for name in ("dataset", "num_replicas", "rank", "shuffle", "seed", "drop_last", "epoch", "num_samples",
                 "total_size"):
        assert getattr(s, name) == getattr(t, name), name
    assert len(s) == len(t)
    s.close()
    one = DistributedSampler(data, num_replicas=1, rank=0, permutation="torch", seed=5, address=server.address,
                             job="attrs-1", token="t")
    t1 = TorchSampler(data, num_replicas=1, rank=0, seed=5)
    one.epoch = 2  # some loops assign it: the same as set_epoch(2)
    t1.set_epoch(2)
    assert one.epoch == t1.epoch == 2
    assert list(one) == list(t1)
    one.close()


SCRIPT = textwrap.dedent("""
    import itertools, sys
    from croupier.client import DistributedSampler
    s = DistributedSampler(int(sys.argv[1]), job="exit-" + sys.argv[1])
    print(sum(1 for _ in itertools.islice(iter(s), 1000)), flush=True)
""")


@pytest.mark.e2e
@pytest.mark.parametrize("n", [10**6, 10**9, 4 * 10**18])
def test_a_script_that_stops_mid_epoch_exits(n: int) -> None:
    """No close(), no loop to the end: background leasing and the embedded coordinator shut down by themselves."""
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(n)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "1000"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
