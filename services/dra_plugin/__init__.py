"""dra_plugin: the kubelet's Dynamic Resource Allocation plugin (kubelet API v1, driver gpu.bcd.dev).

`devices` plans the pool (whole cards, MIG placements, one counter set per card)
and renders it as resource.k8s.io/v1 ResourceSlices; `plugin` serves the kubelet
(registration, NodePrepareResources / NodeUnprepareResources) and publishes the
slices; `binding` sets the seed's binding conditions; `kubeapi` is the API
server client; `checkpoint` the per-claim PrepareStarted / PrepareCompleted
record; `proto/` the kubelet's wire APIs. Claims become holds in the converger
(services/converger/claims.py): this process never writes a hold file.
"""
