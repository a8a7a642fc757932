"""The kubelet device plugin API v1beta1: the checked-in .proto and its generated code.

`deviceplugin_v1beta1_pb2` (messages) and `deviceplugin_v1beta1_pb2_grpc`
(Registration and DevicePlugin stubs and servicers) are generated: run
`make proto` (or `python -m services.device_plugin.proto.generate`) after a
change to the .proto. A test checks they match a fresh generation. The
constants are the kubelet's (constants.go of the same package).
"""

#: the API version a plugin registers with (RegisterRequest.version).
VERSION = "v1beta1"
#: where the kubelet looks for plugin sockets, and its Registration socket in it.
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
#: Device.health values.
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
