"""helper: the optional root helper (file.write of cdi/allocation-env, file.remove, slice.apply, slice.remove).

A converger that runs as an ordinary user (not root, not on a fake host)
cannot write /etc/cdi or create slices; beside this helper, running as root,
it can. The helper accepts no path, device node, mount or hook from the wire:
requests carry typed fields only (unknown fields refused), and it builds every
path from a validated allocation id and its own directories, and the CDI
content from those fields plus the vendor spec on its own disk, with the same
function the in-process writer uses (shared/holdfiles/files.py, hold_file_bytes).

- `ops.py`: the four operations and `info`, with their checks (no bus).
- `safefs.py`: writes and removals that never follow a symlink.
- `iommu.py`: whether an IOMMU group is a listed GPU's, before a hold names `/dev/vfio/<N>`.
- `service.py`: the micro service (endpoints, replies, logs, metrics).
"""
