"""The network layer: hivemind's DHT and libp2p streams, no training logic."""

import os

# hivemind switches torch to the file_system sharing strategy at import, which starts a
# torch_shm_manager in its own session that outlives a killed node; nothing here shares
# tensors between processes, so keep torch's default.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
