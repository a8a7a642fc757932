"""vfio_switcher: the root process that switches one GPU between its native driver and vfio-pci.

Smallest surface by design: one endpoint, `switch(pci, target)`, for a
canonical PCI address of a card the inventory lists as a GPU; a verified
switch, a rollback to the native driver, or DisruptionRequired (a reboot is
needed) out, as a SwitchReply that is also published on
`vfio_switcher.result`. Nothing else.

- `driver.py`: the DriverPort (read the binding; unbind, driver_override,
  bind, drivers_probe, each with a timeout) and its backends `SysfsDriver`
  (real files under a sysfs root) and `FakeDriver` (in memory).
- `fakehost.py`: `FakeHostDriver`, the same kernel model over the fake host
  file the inventory's fakehw adapter reads, with its injected faults.
- `switch.py`: `switch()`, the checks, the switch, the rollback.
- `service.py`: the micro service (inventory and holder checks, per-card
  serialisation, notices, metrics).
"""
