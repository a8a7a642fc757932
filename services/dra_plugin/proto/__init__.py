"""The kubelet DRA plugin API v1 and v1beta1 and plugin registration API v1: the checked-in .protos and their code.

`dra_v1_pb2` / `dra_v1_pb2_grpc` and `dra_v1beta1_pb2` / `dra_v1beta1_pb2_grpc` (the
DRAPlugin service of each version: NodePrepareResources, NodeUnprepareResources) and
`pluginregistration_v1_pb2` / `pluginregistration_v1_pb2_grpc` (Registration: GetInfo,
NotifyRegistrationStatus) are generated: run `make proto` (or `python -m
services.dra_plugin.proto.generate`) after a change to a .proto. A test checks they match
a fresh generation. `dra_health_v1alpha1_*` and `dra_health_v1_*` are the kubelet's
DRAResourceHealth (KEP 4680) in both versions; services/dra_plugin/health.py serves them and
holds their registration names. The constants are the kubelet's (dra/v1/types.go,
dra/v1beta1/types.go, pluginregistration/v1/constants.go of the same commit).
"""

#: what a DRA plugin lists in PluginInfo.supported_versions for the v1 DRAPlugin service.
DRA_PLUGIN_SERVICE = "v1.DRAPlugin"
#: ... for the v1beta1 DRAPlugin service (what kubelets 1.32 and 1.33 speak).
DRA_PLUGIN_SERVICE_V1BETA1 = "v1beta1.DRAPlugin"
#: PluginInfo.type of a DRA plugin.
DRA_PLUGIN_TYPE = "DRAPlugin"
#: where the kubelet's plugin watcher looks for registration sockets, and where plugins serve.
PLUGINS_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
#: the driver name bcd uses unless configured (DESIGN 10).
DEFAULT_DRIVER = "gpu.bcd.dev"
