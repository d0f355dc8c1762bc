"""The network layer: hivemind's DHT and libp2p streams, no training logic."""

import os

# hivemind switches torch to the file_system sharing strategy at import, which starts a
# torch_shm_manager in its own session that outlives a killed node; nothing here shares
# tensors between processes, so keep torch's default.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

from dht.lazy_scipy import defer_scipy_optimize

defer_scipy_optimize()  # before any hivemind import: its averager imports scipy.optimize
