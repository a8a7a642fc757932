"""kube_reaper: answers "does any pod still hold these devices" and evicts pods holding withdrawn ones.

Reads the kubelet pod-resources API and the host's GPU processes; evicts
through the Kubernetes Eviction API. Built in the Kubernetes holds issue.
It also reads and changes the node's own Kubernetes Node for the converger's
MIG re-layout (nodeapi.py), which holds no Kubernetes credentials itself.
"""
