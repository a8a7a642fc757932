"""helper: the optional root helper (file.write of cdi/allocation-env, file.remove, slice.apply, slice.remove).

It builds every path and CDI content itself from typed fields; nothing from
the wire names a path, hook or device node. Built in the least-privilege issue.
"""
