"""device_plugin: advertises the atoms of BINDING_KUBERNETES holds to the kubelet (device plugin API v1beta1).

Its own process and NATS user rather than a part of kube_reaper: it must
create sockets in the kubelet's device-plugins directory (root-owned on a
worker), which the reaper has no business writing, and it reads the CDI and
run directories the reaper never reads. It writes nothing of bcd's: the
holds on disk are the converger's, and what it advertises is derived from
them and the inventory (`advertise`), served per resource (`plugin`), on
the node bus as `status` and `withdraw` (`service`).
"""
