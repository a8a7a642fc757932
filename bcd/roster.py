"""The services a bcd node runs: one list that `bcd up`, a host install's bus config and
`bcd compose init` all read, so a service added to the node is added to each of them.

It sits below up.py, nodebus.py and compose.py (it imports nothing of bcd), so the node bus
can name the node's services without importing the program that starts them.
"""

from __future__ import annotations

#: the node's services, in the order `bcd up` starts them (the root helper is not one of
#: them: `bcd up --with-helper` and compose add it where a root process may run)
NODE_SERVICES: tuple[str, ...] = ("signer", "inventory", "converger", "gateway_bridge", "kube_reaper", "device_plugin", "dra_plugin", "vfio_switcher")
#: the optional root helper (services/helper)
HELPER = "helper"

__all__ = ["NODE_SERVICES", "HELPER"]
