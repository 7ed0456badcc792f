"""Hostfile parsing, in DeepSpeed's (and OpenMPI's) format: one ``hostname slots=N`` per line.

``#`` starts a comment (whole line or trailing), blank lines are ignored. Parsing is strict: a line that is
not exactly a host and a ``slots=`` count is an error naming ``file:line`` and the text, because a silently
skipped host means a job that starts with fewer ranks than the user asked for.

Host names end up on ssh / pdsh command lines, so they are checked against a narrow pattern (letters, digits,
``. - _ :`` and bracketed IPv6 literals) and may not start with ``-``; nothing in a hostfile can then be read
as a shell metacharacter or as an option of the remote-shell client.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardspeed.launcher.errors import LauncherError

# A DNS name, IPv4 address or bare IPv6 address; or an IPv6 literal in brackets ("[fe80::1]"). The first
# character is never "-": "ssh -oProxyCommand=..." would otherwise turn a host name into an ssh option.
_PLAIN_HOST = r"[A-Za-z0-9_.:][A-Za-z0-9_.:-]*"
_BRACKETED_IPV6 = r"\[[0-9A-Fa-f:.%A-Za-z]+\]"
HOSTNAME_PATTERN = re.compile(rf"(?:{_PLAIN_HOST}|{_BRACKETED_IPV6})")
_MAX_HOSTNAME_LENGTH = 255
_SLOTS_PATTERN = re.compile(r"slots=([0-9]+)")


def validate_hostname(name: str, where: str) -> str:
    """Return ``name`` if it is a safe host name; otherwise raise, naming ``where`` it came from."""
    if len(name) > _MAX_HOSTNAME_LENGTH or not HOSTNAME_PATTERN.fullmatch(name):
        raise LauncherError(
            f"{where}: invalid host name {name!r}; a host name may contain letters, digits and "
            "'.', '-', '_', ':' (not starting with '-'), or be an IPv6 address in brackets like [fe80::1]"
        )
    return name


def unbracketed(host: str) -> str:
    """The address ssh and TCP want: ``[fe80::1]`` → ``fe80::1``; other names unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def parse_hostfile_text(text: str, source: str) -> dict[str, int]:
    """Parse hostfile text into ``{host: slots}`` in file order (the order decides node ranks).

    ``source`` names the file in error messages.
    """
    slots_by_host: dict[str, int] = {}
    line_of_host: dict[str, int] = {}
    for line_number, raw_line in enumerate(text.splitlines(), start=1):
        where = f"{source}:{line_number}"
        content = raw_line.split("#", 1)[0].strip()
        if not content:
            continue
        fields = content.split()
        slots_match = _SLOTS_PATTERN.fullmatch(fields[1]) if len(fields) == 2 else None
        if slots_match is None:
            raise LauncherError(
                f"{where}: cannot parse hostfile line {raw_line.strip()!r}; expected 'hostname slots=N' "
                "(e.g. 'worker-1 slots=8'), a '#' comment or a blank line"
            )
        host = validate_hostname(fields[0], where)
        slots = int(slots_match.group(1))
        if slots < 1:
            raise LauncherError(f"{where}: host {host!r} has slots={slots}; slots must be at least 1")
        if host in slots_by_host:
            raise LauncherError(
                f"{where}: host {host!r} is listed twice (first at line {line_of_host[host]}); "
                "list each host once with its total slot count"
            )
        slots_by_host[host] = slots
        line_of_host[host] = line_number
    if not slots_by_host:
        raise LauncherError(f"{source}: hostfile lists no hosts; expected lines like 'worker-1 slots=8'")
    return slots_by_host


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile_text`)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise LauncherError(f"--hostfile: cannot read {str(path)!r}: {error.strerror or error}") from error
    return parse_hostfile_text(text, str(path))
