"""device_plugin: advertises the atoms of BINDING_KUBERNETES holds to the kubelet (issue 15).

So far only its wire API: `proto/`, the kubelet device plugin API v1beta1.
"""
