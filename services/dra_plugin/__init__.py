"""dra_plugin: the kubelet's Dynamic Resource Allocation plugin (issue 17).

So far only its wire APIs: `proto/`, the kubelet DRA plugin API v1 and the
plugin registration API v1, checked in with their generated code.
"""
