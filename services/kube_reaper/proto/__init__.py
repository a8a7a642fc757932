"""The kubelet pod-resources v1 API: `podresources_v1.proto` and its generated code.

`podresources_v1_pb2.py` and `podresources_v1_pb2_grpc.py` are generated and
checked in; regenerate them with `make proto` (`python -m
services.kube_reaper.proto.generate`) after changing the .proto. A test checks
the checked-in files match a fresh generation.
"""
