"""A hold's env file (`<run_dir>/allocations/<allocation>.env`): its lines and its bytes.

The file a process outside any container sources to use the hold, so its one
rule is that every reader reads it alike. It knows a hold only by the facts it
writes (`HoldEnv`, which a HoldContent is): content.py checks, when a
HoldContent is built, that these lines can be written, so it imports this
module and not the other way round.

Decisions (DESIGN 5, "Env file"):

* Env file values. Every line of the env file is read to the same value by
  a shell sourcing it (`. file`), `docker run --env-file` and systemd's
  `EnvironmentFile=` (`shared.schemas.common.env_value_problem`): the three
  disagree on quotes, backslashes, `$` and whitespace and no quoting suits
  all of them (docker keeps quotes), so no value holds those. bcd's own
  values are ids, the slice name (a `-` of the id spelled `.`, see
  `shared.slices.slice_name`), uuids and the MPS pipe directory; a spec's
  env value with any of them is refused when the spec is decoded.
* Env file keys. A spec's line whose key the loader, libc, the container
  runtime's GPU hook, the MPS client or a shell reads (`LD_*`, `PATH`,
  `NVIDIA_*`, ...: `shared.schemas.common.env_key_problem`) is refused when
  the spec is decoded and again when a HoldContent is built, so no writer
  (the root helper included) puts one in this file.
"""

from __future__ import annotations

from typing import Protocol


class HoldEnv(Protocol):
    """What the env file says of a hold: a HoldContent (content.py) is one."""

    @property
    def allocation_id(self) -> str: ...
    @property
    def reservation_id(self) -> str: ...
    @property
    def cgroup_parent(self) -> str: ...
    @property
    def mps_pipe_dir(self) -> str: ...
    @property
    def env(self) -> tuple[str, ...]: ...
    @property
    def visible_devices(self) -> str: ...


def env_lines(hold: HoldEnv) -> list[str]:
    """The env file's lines in the seed's order (NVIDIA_VISIBLE_DEVICES for every binding)."""
    lines = [f"BCD_ALLOCATION_ID={hold.allocation_id}"]
    if hold.cgroup_parent:
        lines.append(f"BCD_CGROUP_PARENT={hold.cgroup_parent}")
    if hold.mps_pipe_dir:
        lines.append(f"CUDA_MPS_PIPE_DIRECTORY={hold.mps_pipe_dir}")
    lines.append(f"BCD_RESERVATION_ID={hold.reservation_id}")
    lines.append(f"NVIDIA_VISIBLE_DEVICES={hold.visible_devices}")
    lines.extend(hold.env)
    return lines


def render_env_file(hold: HoldEnv) -> bytes:
    """One KEY=VALUE per line, trailing newline."""
    return ("\n".join(env_lines(hold)) + "\n").encode()
