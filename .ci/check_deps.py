"""`pip check`, limited to attnlab and what it pulls in.

A CI machine may carry packages of its own (pip check would fail on their conflicts with the oldest releases we
install); this walks the requirements of attnlab[dev] transitively and fails if an installed release does not satisfy
one of them.
"""

import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def main() -> int:
    todo, seen, problems = [("attnlab", frozenset({"dev"}))], set(), []
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        dist = md.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} requires {req}, which is not installed")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                problems.append(f"{name} requires {req}, but {req.name} {version} is installed")
            todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    for p in problems:
        print(p)
    print(f"{len(seen)} distributions checked, {len(problems)} conflicts")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
