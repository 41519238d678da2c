"""Replication validation: state declared identical across ranks is compared by digest before saving."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

_MISSING = "<missing>"


def find_mismatches(
    component: str, fingerprints: Mapping[int, Mapping[str, str]], domains: Sequence[Sequence[int]], limit: int = 5
) -> str | None:
    """One message naming the component, the keys and the ranks that differ; None when all agree.

    Within each domain (the ranks that must hold identical state) the majority digest is the reference;
    ties go to the group holding the lowest rank.
    """
    problems: list[str] = []
    for domain in domains:
        ranks = sorted(domain)
        keys = sorted({k for r in ranks for k in fingerprints[r]})
        for key in keys:
            by_digest: dict[str, list[int]] = defaultdict(list)
            for r in ranks:
                by_digest[fingerprints[r].get(key, _MISSING)].append(r)
            if len(by_digest) == 1:
                continue
            reference = max(by_digest.values(), key=lambda rs: (len(rs), -rs[0]))
            differ = [r for r in ranks if r not in reference]
            problems.append(
                f"key {key!r} differs on rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                f"(rank{'s' if len(reference) > 1 else ''} {', '.join(map(str, reference))} agree)"
            )
    if not problems:
        return None
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"replicated component {component!r} is not identical across ranks: " + "; ".join(problems[:limit]) + more
