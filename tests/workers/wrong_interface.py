"""An elastic worker whose Gloo is told to use an interface this machine does not have, as a
misconfigured node's would be: hvd.init() fails on it. Not a lost peer: it must not be tried again."""
import os

import horovod.torch as hvd

os.environ["HOROVOD_GLOO_IFACE"] = "hvdnone0"
hvd.init()
print("initialized on an interface that does not exist", flush=True)
