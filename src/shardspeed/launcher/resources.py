"""Which hosts and which slots (device indices) a job runs on: DeepSpeed's ``--include`` / ``--exclude`` /
``--num_nodes`` / ``--num_gpus`` rules applied to the hostfile's resource pool.

A pool maps each host to its list of slot indices, in hostfile order; that order decides node ranks and the
first host is the rendezvous master. Filter syntax (DeepSpeed's)::

    worker-1@worker-2:0,2      # all of worker-1, slots 0 and 2 of worker-2

``@`` separates hosts; ``host:i,j`` names slots of a host, a bare host means all of its slots. ``--include``
keeps only what is named; ``--exclude`` removes what is named (a bare host removes the host). IPv6 hosts are
written in brackets (``[fe80::1]:0,1``) so their colons are not mistaken for the slot separator.
"""

from __future__ import annotations

from shardspeed.config.errors import did_you_mean
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.hostfile import validate_hostname

ResourcePool = dict[str, list[int]]
"""host → slot indices it runs on, in hostfile order."""


def pool_from_slot_counts(slots_by_host: dict[str, int]) -> ResourcePool:
    """Every slot of every host: ``{"a": 2}`` → ``{"a": [0, 1]}``."""
    return {host: list(range(count)) for host, count in slots_by_host.items()}


def _split_host_and_slots(entry: str, flag: str) -> tuple[str, str | None]:
    """``host`` → (host, None); ``host:0,1`` → (host, "0,1"); ``[v6]:0`` → ("[v6]", "0")."""
    if entry.startswith("["):
        close = entry.find("]")
        if close < 0:
            raise LauncherError(f"{flag}: unclosed '[' in {entry!r}; write IPv6 hosts as [addr] or [addr]:0,1")
        host, rest = entry[: close + 1], entry[close + 1 :]
        if rest and not rest.startswith(":"):
            raise LauncherError(f"{flag}: unexpected {rest!r} after {host!r}; expected ':slot,slot' or nothing")
        return host, (rest[1:] if rest else None)
    host, colon, slots = entry.partition(":")
    return host, (slots if colon else None)


def parse_host_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse ``host1@host2:0,2`` into ``{host1: None, host2: [0, 2]}`` (None = the whole host).

    A host named twice has its slot lists merged (naming it bare anywhere means the whole host).
    """
    if not spec.strip():
        raise LauncherError(f"{flag}: empty filter; expected e.g. 'worker-1@worker-2:0,2'")
    parsed: dict[str, list[int] | None] = {}
    for entry in spec.split("@"):
        host, slots_text = _split_host_and_slots(entry.strip(), flag)
        validate_hostname(host, f"{flag} {spec!r}")
        slots: list[int] | None = None
        if slots_text is not None:
            try:
                slots = [int(token) for token in slots_text.split(",")]
            except ValueError:
                raise LauncherError(
                    f"{flag}: bad slot list {slots_text!r} for host {host!r} in {spec!r}; "
                    "expected comma-separated slot indices like '0,2'"
                ) from None
            if any(slot < 0 for slot in slots):
                raise LauncherError(f"{flag}: negative slot index in {slots_text!r} for host {host!r}")
        if host in parsed and (parsed[host] is None or slots is None):
            parsed[host] = None
        elif host in parsed:
            parsed[host] = sorted(set(parsed[host] or []) | set(slots or []))
        else:
            parsed[host] = slots
    return parsed


def _check_filter_against_pool(pool: ResourcePool, wanted: dict[str, list[int] | None], flag: str) -> None:
    """Every host and slot named in a filter must exist: a typo should fail, not silently run elsewhere."""
    for host, slots in wanted.items():
        if host not in pool:
            raise LauncherError(
                f"{flag}: host {host!r} is not in the resource pool{did_you_mean(host, pool)}; "
                f"known hosts: {', '.join(pool)}"
            )
        missing = [slot for slot in slots or [] if slot not in pool[host]]
        if missing:
            raise LauncherError(f"{flag}: host {host!r} has no slot(s) {missing}; its slots are {pool[host]}")


def apply_include(pool: ResourcePool, spec: str) -> ResourcePool:
    """Keep only the hosts/slots named in ``spec`` (order stays the pool's)."""
    wanted = parse_host_filter(spec, "--include")
    _check_filter_against_pool(pool, wanted, "--include")
    kept: ResourcePool = {}
    for host, slots in pool.items():
        if host in wanted:
            wanted_slots = wanted[host]
            kept[host] = list(slots) if wanted_slots is None else [s for s in slots if s in wanted_slots]
    return kept


def apply_exclude(pool: ResourcePool, spec: str) -> ResourcePool:
    """Drop the hosts/slots named in ``spec``; a host left with no slots is dropped."""
    unwanted = parse_host_filter(spec, "--exclude")
    _check_filter_against_pool(pool, unwanted, "--exclude")
    kept: ResourcePool = {}
    for host, slots in pool.items():
        unwanted_slots = unwanted.get(host, [])
        if unwanted_slots is None:
            continue
        remaining = [slot for slot in slots if slot not in unwanted_slots]
        if remaining:
            kept[host] = remaining
    return kept


def select_resources(
    pool: ResourcePool,
    *,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    procs_per_node: int | None = None,
) -> ResourcePool:
    """Apply DeepSpeed's selection rules to ``pool`` and return the hosts/slots the job runs on.

    ``include`` and ``exclude`` are mutually exclusive, and neither may be combined with ``num_nodes`` /
    ``procs_per_node`` (the filter already says exactly which slots to use; mixing the two would leave it
    ambiguous which rule wins). ``num_nodes`` keeps the first K hosts; ``procs_per_node`` keeps slots [0, N)
    of each host and must not exceed any host's slot count.
    """
    if include is not None and exclude is not None:
        raise LauncherError("--include and --exclude cannot be used together; use one filter")
    filter_flag = "--include" if include is not None else "--exclude" if exclude is not None else None
    if filter_flag is not None and (num_nodes is not None or procs_per_node is not None):
        raise LauncherError(
            f"{filter_flag} cannot be combined with --num_nodes / --num_gpus / --num_procs; "
            "the filter already chooses the hosts and slots"
        )
    selected = dict(pool)
    if include is not None:
        selected = apply_include(selected, include)
    if exclude is not None:
        selected = apply_exclude(selected, exclude)
    if num_nodes is not None:
        if num_nodes < 1 or num_nodes > len(selected):
            raise LauncherError(f"--num_nodes {num_nodes}: must be between 1 and the {len(selected)} host(s) available")
        selected = dict(list(selected.items())[:num_nodes])
    if procs_per_node is not None:
        if procs_per_node < 1:
            raise LauncherError(f"--num_gpus/--num_procs {procs_per_node}: must be at least 1")
        for host, slots in selected.items():
            if procs_per_node > len(slots):
                raise LauncherError(
                    f"--num_gpus/--num_procs {procs_per_node}: host {host!r} has only {len(slots)} slot(s)"
                )
        selected = {host: slots[:procs_per_node] for host, slots in selected.items()}
    if not selected:
        raise LauncherError(f"{filter_flag or 'selection'}: no hosts/slots left to run on")
    return selected
