"""vfio_switcher: the root process that switches one GPU between its native driver and vfio-pci.

Smallest surface by design: canonical PCI address of a listed GPU in, a
verified switch or a rollback out. Built in the VFIO issue.
"""
